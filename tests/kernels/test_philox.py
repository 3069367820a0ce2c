"""The batched noise of the counter-based streams is bit-identical to ``Streams`` for
every backend: numba (``kernels/philox.py``) and Triton (``kernels/philox_triton.py``,
under the interpreter on CPU), seeds above 2**32 and long rows (several Philox blocks)
included; and the Triton backend's noise honours mutation (c)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rheoplan.config import SamplingConfig
from rheoplan.kernels import noise
from rheoplan.kernels.noise import counter_rows, gumbel_rows, numba_uniform, uniform_rows
from rheoplan.kernels.verify.cpu import root_draws
from rheoplan.rng import Purpose, Streams
from rheoplan.testing import mutation
from rheoplan.verify import walk_roots


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
    want_g = torch.stack([s.gumbel(step, b, v, Purpose.VERIFY_RESIDUAL, n) for b, v in zip(trees.tolist(),
                                                                                        nodes.tolist())])
    if torch.device(dev).type == "cuda":
        # the uniforms are bit-identical (above); -log(-log(u)) runs torch's float64 log on the
        # device, not the CPU's: on an H200, 67 of 7,400 draws differed, by at most 4.1e-15
        # relative (30 ulp where g is near 0; scripts/gpu_diagnose.py)
        torch.testing.assert_close(g, want_g, rtol=1e-13, atol=1e-14)
    else:
        assert torch.equal(g, want_g)


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


@pytest.mark.parametrize("R", [0, 1, 3, 8, 9, 40])
def test_counter_rows_few_rows_as_python_ints_equal_numpys(monkeypatch, R):
    """``counter_rows`` builds up to ``_FEW_ROWS`` rows with Python ints and more with
    numpy: the same words either way, for one step or one per row, wrapped to 64 bits as
    numpy wraps (a node of -1 and a step near 2**62)."""
    rnd = np.random.default_rng(R)
    trees = rnd.integers(0, 2**20, R)
    nodes = np.concatenate([[-1], rnd.integers(0, 4096, R)])[:R]
    for step in (7, 2**62 + 3, rnd.integers(0, 2**40, R)):
        got = counter_rows(step, trees, nodes, 2)
        monkeypatch.setattr(noise, "_FEW_ROWS", -1)  # numpy for every row count
        want = counter_rows(step, trees, nodes, 2)
        monkeypatch.undo()
        assert got.dtype == want.dtype == np.uint64 and got.shape == want.shape == (R, 4)
        assert (got == want).all()


def test_numba_rows_at_different_steps_match_streams():
    """A batch's rows are at different steps: one numba call with a step per row."""
    s = Streams(5)
    steps, trees, nodes = torch.tensor([0, 4, 4, 9]), torch.tensor([0, 1, 2, 3]), torch.tensor([0, 0, 7, 2])
    got = numba_uniform(s.seed, steps, trees, nodes, s.purpose_key(Purpose.VERIFY_RESIDUAL), 11)
    want = torch.stack([s.uniform(int(a), int(b), int(v), Purpose.VERIFY_RESIDUAL, 11)
                        for a, b, v in zip(steps, trees, nodes)])
    assert torch.equal(got, want)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_walk_roots_with_the_numba_draw_emits_the_streams_tokens(temperature):
    """``walk_roots`` drawing through the numba kernel (``root_draws``: what
    ``rheoplan.walk.verify_roots`` passes on a non-reference backend, the stream made as
    the filter reads it) emits the tokens it draws from ``Streams`` row by row, also with
    two rows at the same step and a vocabulary not a multiple of Philox's 4 words."""
    V = 3001
    logits = torch.randn(5, V, generator=torch.Generator().manual_seed(1)) * 3
    sampling = SamplingConfig(temperature=temperature)
    s = Streams(2**40 + 3)
    steps, keys, nodes = [3, 0, 8, 8, 1], [0, 1, 2, 3, 4], [0, 0, 0, 5, 0]
    residual = s.purpose_key(Purpose.VERIFY_RESIDUAL)
    fast = walk_roots(logits, sampling, s, steps, keys, nodes,
                      lambda p, st, k, v: root_draws(p, s.seed, st, k, v, residual))
    assert fast == walk_roots(logits, sampling, s, steps, keys, nodes)
