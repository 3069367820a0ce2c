"""Triton tree attention vs torch SDPA with the dense mask, on tiny shapes (interpreter).

Tolerance 2e-5 (float32, "ieee" dots): the online softmax sums in a different order than
SDPA. On a GPU the same tolerance holds because float32 dots are forced to "ieee"; 16-bit
inputs are compared at 2e-2 (bf16 has 8 mantissa bits; P is rounded to V's dtype).
"""

from __future__ import annotations

import pytest
import torch

from rheoplan.kernels.tree_attention import reference
from rheoplan.planner.linearize import pack_bits


def _case(B=2, Hq=4, Hkv=2, L=20, P=24, d=16, seed=0, prefix=None, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    parent = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, L)]
    mask = torch.zeros(B, L, L, dtype=torch.bool)
    for b in range(B):
        for i in range(L):
            j = i
            while j >= 0:
                mask[b, i, j] = True
                j = parent[j]
    mask[B - 1, L - 3:] = False  # padded linear rows: see only the prefix
    plen = torch.tensor(prefix if prefix is not None else [P - 5, P])
    return (r(B, Hq, L, d), r(B, Hkv, P, d), r(B, Hkv, P, d), r(B, Hkv, L, d), r(B, Hkv, L, d), plen,
            pack_bits(mask))


def test_dense_mask_example():
    m = reference.dense_mask(torch.tensor([1]), torch.tensor([[[1], [3]]]), 2)
    assert m.tolist() == [[[True, False, True, False], [True, False, True, True]]]


def test_reference_empty_rows_are_zero():
    """Padded tree rows with no prefix see nothing: 0, not SDPA's NaN."""
    out = reference.tree_attention(*_case(L=6, P=4, prefix=[0, 0]))
    assert torch.isfinite(out).all()
    assert (out[1, :, 3:] == 0).all() and (out[0].abs().sum() > 0)


def _run(device, args, **kw):
    from rheoplan.kernels.tree_attention import triton as tk

    return tk.tree_attention(*(a.to(device) for a in args), **kw).cpu()


@pytest.mark.interpreter
@pytest.mark.parametrize("L,P", [(20, 24), (70, 8)])  # 70: two bit-words per row
def test_triton_matches_sdpa(device, L, P):
    args = _case(L=L, P=P)
    torch.testing.assert_close(_run(device, args, block_m=16, block_n=16), reference.tree_attention(*args),
                               rtol=2e-5, atol=2e-5)


@pytest.mark.interpreter
@pytest.mark.parametrize("d", [8, 24, 80, 96])  # padded to 16, 32, 128, 128 with masked lanes
def test_head_dims_not_power_of_two(device, d):
    args = _case(B=1, Hq=2, Hkv=1, L=9, P=5, d=d, prefix=[4])
    torch.testing.assert_close(_run(device, args, block_m=16, block_n=16), reference.tree_attention(*args),
                               rtol=2e-5, atol=2e-5)


@pytest.mark.interpreter
def test_strided_query_and_cache_views(device):
    """q as the model makes it (``view(B, L, H, d).transpose(1, 2)``) and the cache as a
    slice of a longer buffer: no copies, and the output is still right (readiness item 3)."""
    q, kc, vc, kt, vt, plen, bits = _case(L=12, P=10)
    B, Hq, L, d = q.shape
    q_strided = q.transpose(1, 2).contiguous().transpose(1, 2)
    assert not q_strided.is_contiguous()
    big_k = torch.randn(B, 2, 30, d)
    big_k[:, :, 3:13] = kc
    kc_view = big_k[:, :, 3:13]
    args = (q_strided, kc_view, vc, kt, vt, plen, bits)
    out = _run(device, args, block_m=16, block_n=16)
    torch.testing.assert_close(out, reference.tree_attention(q, kc, vc, kt, vt, plen, bits), rtol=2e-5, atol=2e-5)


@pytest.mark.interpreter
def test_output_layout_is_transformers_layout(device):
    from rheoplan.kernels.tree_attention import triton as tk

    args = _case(L=5, P=3)
    out = tk.tree_attention(*(a.to(device) for a in args), block_m=16, block_n=16)
    assert out.transpose(1, 2).is_contiguous()


@pytest.mark.interpreter
def test_empty_rows_write_zero(device):
    """prefix_len 0 and padded rows that see nothing: 0, never NaN (readiness item 6)."""
    args = _case(L=6, P=4, prefix=[0, 0])
    out = _run(device, args, block_m=16, block_n=16)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, reference.tree_attention(*args), rtol=2e-5, atol=2e-5)


@pytest.mark.interpreter
def test_prefix_beyond_len_is_not_read(device):
    """Cache entries at or after prefix_len may hold anything (here NaN): never read."""
    q, kc, vc, kt, vt, plen, bits = _case(L=7, P=40, prefix=[3, 17])
    kc[0, :, 3:] = float("nan")
    vc[1, :, 17:] = float("nan")
    out = _run(device, (q, kc, vc, kt, vt, plen, bits), block_m=16, block_n=16)
    assert torch.isfinite(out).all()
    ref = reference.tree_attention(q, kc.nan_to_num(0.0), vc.nan_to_num(0.0), kt, vt, plen, bits)
    torch.testing.assert_close(out, ref, rtol=2e-5, atol=2e-5)


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16bit_inputs(device, dtype):
    if dtype == torch.bfloat16 and device == "cpu":
        pytest.skip("the Triton interpreter computes bfloat16 tl.dot wrongly (numpy has no bf16); GPU only")
    args = _case(B=1, L=10, P=6, prefix=[6], dtype=dtype)
    ref = reference.tree_attention(*(a.float() if a.is_floating_point() else a for a in args))
    out = _run(device, args, block_m=16, block_n=16)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)


def test_bad_arguments_rejected():
    from rheoplan.kernels.tree_attention import triton as tk

    q, kc, vc, kt, vt, plen, bits = _case(L=5, P=3)
    with pytest.raises(ValueError, match="block_m"):
        tk.tree_attention(q, kc, vc, kt, vt, plen, bits, block_m=24)
    with pytest.raises(ValueError, match="ancestor_bits"):
        tk.tree_attention(q, kc, vc, kt, vt, plen, bits[:, :4])
    with pytest.raises(ValueError, match="Hq=4 must be a multiple of Hkv=3"):
        tk.tree_attention(q, *(t.repeat(1, 3, 1, 1)[:, :3] for t in (kc, vc, kt, vt)), plen, bits)
    with pytest.raises(ValueError, match="share dtype"):
        tk.tree_attention(q, kc.double(), vc, kt, vt, plen, bits)


def test_launch_config_fits_sm90():
    """Shared memory of the chosen tiles (Q + K + V tiles, 3 pipeline stages for K/V) stays
    under sm_90's 232,448 B per block for every dtype and padded head dim."""
    from rheoplan.kernels.tree_attention import triton as tk

    for dtype, size in ((torch.float32, 4), (torch.bfloat16, 2), (torch.float16, 2)):
        for d_pad in (16, 32, 64, 128, 256):
            bm, bn, warps = tk.launch_config(dtype, d_pad)
            smem = size * d_pad * (bm + 3 * 2 * bn)
            assert smem < 232_448, (dtype, d_pad, smem)
            assert warps in (4, 8) and bn <= 64


@pytest.mark.interpreter
@pytest.mark.parametrize("splits", [2, 3])
def test_split_prefix(device, splits):
    """The prefix shared by several programs (flash-decoding), partials merged afterwards:
    same output; a split whose chunk is past prefix_len (sees nothing) weighs 0."""
    args = _case(L=9, P=48, prefix=[5, 48])  # tree 0: splits 2.. see no prefix at all
    ref = reference.tree_attention(*args)
    torch.testing.assert_close(_run(device, args, block_m=16, block_n=16, num_splits=splits), ref,
                               rtol=2e-5, atol=2e-5)
    empty = _case(L=6, P=40, prefix=[0, 0])  # padded rows see nothing in any split: 0
    torch.testing.assert_close(_run(device, empty, block_m=16, block_n=16, num_splits=splits),
                               reference.tree_attention(*empty), rtol=2e-5, atol=2e-5)


def test_combine_splits_example():
    from rheoplan.kernels.tree_attention import triton as tk

    m = torch.tensor([0.0, 1.0]).view(2, 1, 1, 1)
    lsum = torch.ones(2, 1, 1, 1)
    acc = torch.tensor([2.0, 4.0]).view(2, 1, 1, 1, 1)
    out = torch.empty(1, 1, 1, 1)
    tk.combine_splits_reference(m, lsum, acc, out, 1)
    e = torch.exp(torch.tensor(-1.0))
    assert torch.allclose(out.flatten(), ((2 * e + 4) / (e + 1)).flatten())


@pytest.mark.interpreter
@pytest.mark.parametrize("splits,d,d_pad", [(3, 24, 32), (1, 16, 16), (5, 64, 64)])
def test_combine_splits_kernel_matches_reference(device, splits, d, d_pad):
    """The one-launch merge equals the torch one: splits that saw nothing (max -inf, sum 0)
    weigh 0, rows no split saw come out 0, the padded head lanes are not written, and the
    output is the transposed view of a ``[B, L, Hq, d]`` buffer, as ``tree_attention`` uses."""
    from rheoplan.kernels.tree_attention import triton as tk

    g = torch.Generator().manual_seed(splits + d)
    B, Hq, L = 2, 3, 5
    m = torch.randn(splits, B, Hq, L, generator=g) * 3
    lsum = torch.rand(splits, B, Hq, L, generator=g) + 0.1
    acc = torch.randn(splits, B, Hq, L, d_pad, generator=g)
    m[0, 0, 1] = float("-inf")  # one split saw nothing for these rows
    lsum[0, 0, 1], acc[0, 0, 1] = 0.0, 0.0
    m[:, 1, 2, 3] = float("-inf")  # a row no split saw
    lsum[:, 1, 2, 3], acc[:, 1, 2, 3] = 0.0, 0.0
    want = torch.empty(B, Hq, L, d)
    tk.combine_splits_reference(m, lsum, acc, want, d)
    buf = torch.full((B, L, Hq, d + 3), float("nan"), device=device)
    got = buf[..., :d].transpose(1, 2)
    tk.combine_splits(*(t.to(device) for t in (m, lsum, acc)), got, d)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-6)
    assert torch.equal(got[1, 2, 3].cpu(), torch.zeros(d))
    assert torch.isnan(buf[..., d:]).all()  # nothing past the head dim written
