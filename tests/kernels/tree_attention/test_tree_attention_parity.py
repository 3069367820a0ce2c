"""Triton tree attention vs torch SDPA with the dense mask, on tiny shapes (interpreter).

Tolerance 2e-5 (float32): online softmax sums in a different order than SDPA.
"""

from __future__ import annotations

import pytest
import torch

from rheoplan.kernels.tree_attention import reference
from rheoplan.planner.linearize import pack_bits


def _case(B=2, Hq=4, Hkv=2, L=20, P=24, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    parent = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, L)]
    mask = torch.zeros(B, L, L, dtype=torch.bool)
    for b in range(B):
        for i in range(L):
            j = i
            while j >= 0:
                mask[b, i, j] = True
                j = parent[j]
    mask[1, L - 3:] = False  # padded linear rows: see only the prefix
    return (r(B, Hq, L, d), r(B, Hkv, P, d), r(B, Hkv, P, d), r(B, Hkv, L, d), r(B, Hkv, L, d),
            torch.tensor([P - 5, P]), pack_bits(mask))


def test_dense_mask_example():
    m = reference.dense_mask(torch.tensor([1]), torch.tensor([[[1], [3]]]), 2)
    assert m.tolist() == [[[True, False, True, False], [True, False, True, True]]]


@pytest.mark.interpreter
@pytest.mark.parametrize("L,P", [(20, 24), (70, 8)])  # 70: two bit-words per row
def test_triton_matches_sdpa(device, L, P):
    from rheoplan.kernels.tree_attention import triton as tk

    args = _case(L=L, P=P)
    ref = reference.tree_attention(*args)
    got = tk.tree_attention(*(a.to(device) for a in args)).cpu()
    torch.testing.assert_close(got, ref, rtol=2e-5, atol=2e-5)
