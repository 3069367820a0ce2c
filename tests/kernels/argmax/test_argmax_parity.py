"""The rows' first maximum: the numba scan equals torch's ``max(dim=-1)`` (the reference)
value for value and index for index, ties and block edges included; the dispatcher runs
the reference where the scan does not apply or a row is broken, with torch's answer; and
``greedy_tokens`` picks, and rejects, the same with it as without."""

from __future__ import annotations

import pytest
import torch

from rheoplan.config import SamplingConfig
from rheoplan.distributions import greedy_tokens
from rheoplan.kernels.argmax import cpu, first_max, reference

#: columns where the scan's blocks meet (tied maxima go on both sides)
BLOCK_EDGES = tuple(cpu.BLOCK * k for k in range(1, 4))


def _same(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]) -> None:
    assert torch.equal(a[1], b[1])
    assert torch.equal(a[0], b[0]) or torch.allclose(a[0], b[0], equal_nan=True)
    # the same floats, the sign of a zero included
    assert torch.equal(torch.signbit(a[0]), torch.signbit(b[0]))


def _tied_rows(V: int, seed: int) -> torch.Tensor:
    """Rows whose maximum occurs twice or more, at block edges, first and last columns,
    and rows of equal entries; quantised logits with many ties."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for a, b in [(0, V - 1), (V - 1, V - 1), (0, 0)] + [(e, e + 1) for e in BLOCK_EDGES if e + 1 < V] + \
            [(e - 1, e) for e in BLOCK_EDGES if 0 < e < V]:
        x = torch.randn(V, generator=g)
        x[a] = x[b] = x.max() + 1.0
        rows.append(x)
    rows.append(torch.full((V,), 2.5))
    rows.append(torch.round(torch.randn(V, generator=g)))
    return torch.stack(rows)


@pytest.mark.parametrize("V", [1, 5, 127, 128, 129, 255, 256, 300, 1000, 49152])
def test_the_scan_equals_torchs_max_on_ties_and_block_edges(V):
    x = _tied_rows(V, seed=V)
    assert cpu.applies(x)
    _same(cpu.first_max(x), reference.first_max(x))
    _same(first_max(x), reference.first_max(x))


@pytest.mark.parametrize("shape", [(49152,), (3, 7, 300), (16, 49152), (0, 40)])
def test_the_scan_equals_torchs_max_on_random_logits_of_any_leading_shape(shape):
    g = torch.Generator().manual_seed(len(shape))
    x = torch.randn(shape, generator=g) * 4
    if x.numel():
        x.view(-1, shape[-1])[:, ::7] = float("-inf")  # impossible tokens
    _same(first_max(x), reference.first_max(x))


def test_the_two_zeros_tie_as_they_do_for_torch():
    x = torch.tensor([[-0.0, 0.0, -1.0], [0.0, -0.0, -1.0], [-1.0, -0.0, 0.0], [-3.0, -0.0, -0.0]])
    _same(first_max(x), reference.first_max(x))
    assert first_max(x)[1].tolist() == [0, 0, 1, 1]


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_broken_row_gets_torchs_answer(bad):
    x = torch.randn(4, 300, generator=torch.Generator().manual_seed(1))
    x[2, 171] = bad
    x[2, 250] = bad
    _same(first_max(x), reference.first_max(x))
    nothing = torch.full((2, 300), float("-inf"))  # no finite entry: a -inf maximum
    _same(first_max(nothing), reference.first_max(nothing))


def test_inputs_the_scan_does_not_read_run_the_reference():
    g = torch.Generator().manual_seed(2)
    wide = torch.randn(300, 6, generator=g)
    assert not cpu.applies(wide.t()) and not cpu.applies(wide.to(torch.bfloat16))
    assert not cpu.applies(wide.to(torch.float64)) and not cpu.applies(wide.requires_grad_())
    for x in (wide.t(), wide.to(torch.bfloat16), wide.to(torch.float64)):
        _same(first_max(x), reference.first_max(x))


def test_greedy_tokens_pick_and_reject_the_same_with_the_scan():
    g = torch.Generator().manual_seed(3)
    x = torch.round(torch.randn(9, 49152, generator=g) * 2)  # many ties at the maximum
    greedy = SamplingConfig(temperature=0)
    assert torch.equal(greedy_tokens(x, greedy, first_max=first_max), greedy_tokens(x, greedy))
    x[4, 1000] = float("nan")
    with pytest.raises(ValueError) as fast:
        greedy_tokens(x, greedy, first_max=first_max)
    with pytest.raises(ValueError) as slow:
        greedy_tokens(x, greedy)
    assert str(fast.value) == str(slow.value)
