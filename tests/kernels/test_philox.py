"""The batched noise of the counter-based streams is bit-identical to ``Streams`` for
every backend: numba (``kernels/philox.py``) and Triton (``kernels/philox_triton.py``,
under the interpreter on CPU), seeds above 2**32 and long rows (several Philox blocks)
included; and the Triton backend's noise honours mutation (c)."""

from __future__ import annotations

import pytest
import torch

from rheoplan.kernels.noise import gumbel_rows, uniform_rows
from rheoplan.rng import Purpose, Streams
from rheoplan.testing import mutation


def _expected(streams, step, trees, nodes, purpose, n):
    return torch.stack([streams.uniform(step, b, v, purpose, n) for b, v in zip(trees.tolist(), nodes.tolist())])


@pytest.mark.parametrize("backend", ["reference", "numba", pytest.param("triton", marks=pytest.mark.interpreter)])
@pytest.mark.parametrize("seed,step,n", [(0, 0, 1), (7, 3, 5), (2**40 + 123, 11, 37), (2**62 + 5, 2, 9)])
def test_uniform_rows_match_streams(device, backend, seed, step, n):
    s = Streams(seed)
    trees = torch.tensor([0, 0, 1, 2, 0])
    nodes = torch.tensor([0, 5, 3, 17, 1000])
    want = _expected(s, step, trees, nodes, Purpose.VERIFY_RESIDUAL, n)
    dev = device if backend == "triton" else "cpu"
    got = uniform_rows(s, step, trees.to(dev), nodes.to(dev), Purpose.VERIFY_RESIDUAL, n, backend).cpu()
    assert torch.equal(got, want)
    g = gumbel_rows(s, step, trees.to(dev), nodes.to(dev), Purpose.VERIFY_RESIDUAL, n, backend).cpu()
    assert torch.equal(g, torch.stack([s.gumbel(step, b, v, Purpose.VERIFY_RESIDUAL, n)
                                       for b, v in zip(trees.tolist(), nodes.tolist())]))


@pytest.mark.interpreter
def test_triton_noise_follows_mutation_c(device):
    """``reuse_draft_stream`` collapses the purposes in the device noise too."""
    s = Streams(3)
    trees, nodes = torch.zeros(2, dtype=torch.int64, device=device), torch.tensor([1, 2], device=device)
    draft = uniform_rows(s, 0, trees, nodes, Purpose.DRAFT_SAMPLE, 4, "triton")
    verify = uniform_rows(s, 0, trees, nodes, Purpose.VERIFY_ACCEPT, 4, "triton")
    assert not torch.equal(draft, verify)
    with mutation("reuse_draft_stream"):
        assert torch.equal(uniform_rows(s, 0, trees, nodes, Purpose.VERIFY_ACCEPT, 4, "triton"), draft)
