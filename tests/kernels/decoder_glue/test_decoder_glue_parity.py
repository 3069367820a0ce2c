"""The decoder glue: the numba kernels give the torch reference's bits (transformers'
``LlamaRMSNorm``, residual sum and rotary embedding), over strided views as a layer hands
them over, a row's result never depending on the rows beside it; anything the kernels do
not take runs the reference."""

from __future__ import annotations

import pytest
import torch

from rheoplan.kernels import decoder_glue as glue
from rheoplan.kernels.decoder_glue import cpu, reference



needs_order = pytest.mark.skipif(not cpu.norm_applies(), reason="torch's summation order not found on this CPU")


def _hidden(rows: int, width: int, seed: int) -> torch.Tensor:
    """bfloat16 rows like a residual stream's: most entries small, a few outliers a thousand
    times larger (what made a sum in another order round differently), one row all tiny."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=g) * torch.rand(rows, 1, generator=g) * 4
    spikes = torch.rand(rows, width, generator=g) < 0.01
    x[spikes] *= 1000
    x[0] *= 1e-4
    return x.to(torch.bfloat16)


def _weight(width: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 1)
    return (1 + 0.3 * torch.randn(width, generator=g)).to(torch.bfloat16)


def test_the_reference_norm_is_transformers_llama_norm():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(576, eps=1e-5).to(torch.bfloat16)
    norm.weight.data = _weight(576, 0)
    x = _hidden(5, 576, 0)
    assert torch.equal(reference.rms_norm(x, norm.weight, norm.variance_epsilon), norm(x))


# widths: the tiny test models' 64, SmolLM2's 576, one with a tail past the last whole
# vector, and one long enough for torch's cascade to carry sums into its upper levels
@needs_order
@pytest.mark.parametrize("width", [64, 576, 600, 4136])
@pytest.mark.parametrize("rows", [1, 3, 8, 16])
def test_the_norm_kernels_give_the_references_bits(width, rows):
    for seed in range(3):
        x, d, w = _hidden(rows, width, seed), _hidden(rows, width, seed + 10), _weight(width, seed)
        assert torch.equal(glue.rms_norm(x, w, 1e-5), reference.rms_norm(x, w, 1e-5))
        total, normed = glue.add_rms_norm(x, d, w, 1e-6)
        ref_total, ref_normed = reference.add_rms_norm(x, d, w, 1e-6)
        assert torch.equal(total, ref_total) and torch.equal(normed, ref_normed)


@needs_order
def test_the_norm_kernels_read_strided_rows_and_each_row_alone():
    """A layer's operands: the output projection's rows and a slice of a wider product; a
    row normed alone gives the bits it gets among others."""
    wide = _hidden(6, 960, 3)
    x, w = wide[:, :576], _weight(576, 3)
    assert cpu.row_stride(x) == 960
    out = glue.rms_norm(x, w, 1e-5)
    assert torch.equal(out, reference.rms_norm(x, w, 1e-5))
    assert all(torch.equal(glue.rms_norm(x[r:r + 1], w, 1e-5), out[r:r + 1]) for r in range(6))
    h = _hidden(6, 576, 4).view(2, 3, 576)
    total, normed = glue.add_rms_norm(h, x.view(2, 3, 576), w, 1e-5)
    ref_total, ref_normed = reference.add_rms_norm(h, x.view(2, 3, 576), w, 1e-5)
    assert torch.equal(total, ref_total) and torch.equal(normed, ref_normed)


@pytest.mark.parametrize("head_dim", [16, 64])
def test_the_rotary_kernel_gives_the_references_bits_over_a_products_slice(head_dim):
    g = torch.Generator().manual_seed(head_dim)
    heads, rows, tokens = 3, 4, 2
    product = torch.randn(rows, tokens, (2 * heads + 1) * head_dim, generator=g).to(torch.bfloat16)
    x = product[..., heads * head_dim:2 * heads * head_dim]  # the keys' slice of a q | k | v product
    cos = torch.randn(rows, tokens, head_dim, generator=g).to(torch.bfloat16)
    sin = torch.randn(rows, tokens, head_dim, generator=g).to(torch.bfloat16)
    out = glue.rope(x, cos, sin, head_dim)
    assert out.is_contiguous() and torch.equal(out, reference.rope(x, cos, sin, head_dim))


@pytest.mark.parametrize("batch,tokens,head_dim", [(1, 1, 64), (1, 7, 64), (3, 2, 16), (4, 16, 16)])
def test_the_rotary_and_cache_append_kernel_gives_the_references_bits(batch, tokens, head_dim):
    """One call from a layer's q | k | v product (a strided view, as a wider product's
    columns) to the roped queries and the keys and values written into the cache's buffers:
    the reference's bits, the buffers' other columns untouched."""
    g = torch.Generator().manual_seed(batch * 100 + tokens)
    q_heads, kv_heads, columns, at = 3, 2, 40, 5
    width = (q_heads + 2 * kv_heads) * head_dim
    qkv = torch.randn(batch, tokens, width + 8, generator=g).to(torch.bfloat16)[..., :width]
    cos = torch.randn(batch, tokens, head_dim, generator=g).to(torch.bfloat16)
    sin = torch.randn(batch, tokens, head_dim, generator=g).to(torch.bfloat16)
    keys = torch.randn(batch, kv_heads, columns, head_dim, generator=g).to(torch.bfloat16)
    values = torch.randn(batch, kv_heads, columns, head_dim, generator=g).to(torch.bfloat16)
    k_ref, v_ref = keys.clone(), values.clone()
    q = glue.rope_qkv_append(qkv, q_heads, cos, sin, head_dim, keys, values, at)
    q_ref = reference.rope_qkv_append(qkv, q_heads, cos, sin, head_dim, k_ref, v_ref, at)
    assert q.is_contiguous() and torch.equal(q, q_ref)
    assert torch.equal(keys, k_ref) and torch.equal(values, v_ref)
    # the reference is the separate path's operations: the queries' and the keys' rotary
    # embedding of their slices, the values as they are
    wq, wk = q_heads * head_dim, kv_heads * head_dim
    assert torch.equal(q_ref, reference.rope(qkv[..., :wq], cos, sin, head_dim))
    assert torch.equal(k_ref[:, :, at:at + tokens],
                       reference.rope(qkv[..., wq:wq + wk], cos, sin, head_dim).unflatten(-1, (-1, head_dim)).transpose(1, 2))
    assert torch.equal(v_ref[:, :, at:at + tokens], qkv[..., wq + wk:].unflatten(-1, (-1, head_dim)).transpose(1, 2))


def test_the_rotary_and_cache_append_kernel_runs_only_where_it_applies(monkeypatch):
    calls = []
    real = cpu.rope_qkv_append
    monkeypatch.setattr(cpu, "rope_qkv_append", lambda *a: calls.append(1) or real(*a))
    g = torch.Generator().manual_seed(7)
    qkv = torch.randn(2, 3, 5 * 16, generator=g)
    cos = torch.randn(2, 3, 16, generator=g)
    buffers = torch.zeros(2, 2, 8, 16), torch.zeros(2, 2, 8, 16)
    for dtype, at, contiguous in ((torch.float32, 0, True), (torch.bfloat16, 0, False), (torch.bfloat16, 5, True),
                                  (torch.bfloat16, 6, True)):
        x, c = qkv.to(dtype), cos.to(dtype)
        k, v = (b.to(dtype) for b in buffers)
        if not contiguous:
            k, v = (torch.zeros(2, 8, 2, 16, dtype=dtype).transpose(1, 2) for _ in range(2))
        kr, vr = k.clone(), v.clone()
        if at + 3 > 8:
            with pytest.raises(RuntimeError):  # no room: the reference's copy refuses it
                glue.rope_qkv_append(x, 1, c, c, 16, k, v, at)
            continue
        q = glue.rope_qkv_append(x, 1, c, c, 16, k, v, at)
        assert torch.equal(q, reference.rope_qkv_append(x, 1, c, c, 16, kr, vr, at))
        assert torch.equal(k, kr) and torch.equal(v, vr)
    assert calls == [1]  # only the contiguous bfloat16 buffers with room took the kernel


def test_the_reference_rope_is_transformers_rotary_embedding():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, 4, 16, generator=g).to(torch.bfloat16)  # [rows, heads, tokens, head_dim]
    cos = torch.randn(2, 4, 16, generator=g).to(torch.bfloat16)
    sin = torch.randn(2, 4, 16, generator=g).to(torch.bfloat16)
    want, _ = apply_rotary_pos_emb(q, q, cos, sin)
    signed = torch.cat((-sin[..., :8], sin[..., 8:]), dim=-1)
    got = reference.rope(q.transpose(1, 2).flatten(-2), cos, signed, 16)  # [rows, tokens, heads * head_dim]
    assert torch.equal(got.unflatten(-1, (3, 16)).transpose(1, 2), want)


def test_what_the_kernels_do_not_take_runs_the_reference(monkeypatch):
    calls = []
    for name in ("rms_norm", "add_rms_norm", "rope"):
        real = getattr(cpu, name)
        monkeypatch.setattr(cpu, name, lambda *a, real=real, name=name: calls.append(name) or real(*a))
    g = torch.Generator().manual_seed(5)
    x32 = torch.randn(3, 64, generator=g)
    w32 = torch.rand(64, generator=g) + 0.5
    assert torch.equal(glue.rms_norm(x32, w32, 1e-5), reference.rms_norm(x32, w32, 1e-5))  # float32
    x = x32.to(torch.bfloat16)
    w = w32.to(torch.bfloat16)
    strided = x.t()  # last axis not contiguous
    assert torch.equal(glue.rms_norm(strided, w[:3], 1e-5), reference.rms_norm(strided, w[:3], 1e-5))
    noncontiguous_weight = torch.stack((w, w), dim=1)[:, 0]
    assert torch.equal(glue.rms_norm(x, noncontiguous_weight, 1e-5), reference.rms_norm(x, w, 1e-5))
    cos = torch.randn(3, 16, generator=g).to(torch.bfloat16)
    assert torch.equal(glue.rope(x, cos, cos, 16), reference.rope(x, cos, cos, 16))
    assert calls == ["rope"]  # only the last call qualified
    monkeypatch.setattr(cpu, "summation_lanes", lambda: None)  # torch's summation order not found
    assert torch.equal(glue.rms_norm(x, w, 1e-5), reference.rms_norm(x, w, 1e-5))
    assert torch.equal(glue.add_rms_norm(x, x, w, 1e-5)[1], reference.add_rms_norm(x, x, w, 1e-5)[1])
    assert calls == ["rope"]


def test_the_summation_order_is_found_by_comparing_with_torch(monkeypatch):
    """Each candidate width is tried against torch's sums; a torch that sums otherwise than
    any of them leaves the norms to torch. On x86 (torch's AVX2 and AVX-512 kernels) one of
    them must match: a kernel that sums in another order would otherwise only be skipped."""
    lanes = cpu.summation_lanes()
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        assert lanes is not None
    assert lanes in cpu.LANE_CANDIDATES or lanes is None
    if lanes is not None:
        x = _hidden(5, 576, 7)
        got = torch.empty(5, dtype=torch.float32)
        cpu._sums_of_squares(x.view(torch.int16).numpy().view("uint16"), lanes, got.numpy())
        assert torch.equal(got, x.float().pow(2).sum(-1))
    cpu.summation_lanes.cache_clear()
    try:
        monkeypatch.setattr(cpu, "LANE_CANDIDATES", (4,))  # no torch sums in vectors of 4 floats
        assert cpu.summation_lanes() is None and not cpu.norm_applies()
    finally:
        cpu.summation_lanes.cache_clear()
