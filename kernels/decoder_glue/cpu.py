"""numba CPU path of the decoder's glue for bfloat16 (same signatures as ``reference``).

Why: a decode-time forward of SmolLM2-135M has 30 layers of small operations around its
products: two norms of eight torch operators each, the rotary embedding of the queries
and keys (a concatenation, a roll, two products and a sum), the residual sums. On the
2-core Zen 4 AMD EPYC (bfloat16, packed weights, 4 rows x 1 token) those took ~5 of a
23 ms forward: a norm ~50 us in place, ~20 warm as eight operators, 6-8 warm as one call
here (docs/results.md, "Thirty-second round"). Each function here is one kernel call, its tensors handed over
as raw addresses (``data_ptr``): building numpy views of torch tensors cost ~1.7 us a
tensor, more than the arithmetic of a few rows.

Rounding: bfloat16 entries are widened to float32 exactly, every operation is done in
float32 and rounded to bfloat16 (round to nearest even) where torch's operator would
round, and a norm's sum of squares is summed in the order of torch's own CPU sum (its
vectors, four accumulators and cascade written out, ``_sum_of_squares``), so every
function gives the reference's bits. That order depends on the width of torch's vectors,
which ``summation_lanes`` finds by comparing with torch (not from the CPU's flags: on the
Zen 4 AMD EPYC torch reports AVX-512 and sums in vectors of 8 floats); where neither
width matches, the norms keep torch's operators. A first version that summed in LLVM's
order differed from torch in one output of a 7-token tree verify (layer 25 of
SmolLM2-135M), and from there on in every layer.

Only bfloat16 CPU tensors whose rows are evenly strided with a contiguous last axis
(``applies``); ``rheoplan.kernels.decoder_glue`` sends everything else to the reference.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from llvmlite import ir as llvm_ir
from numba import carray, njit, types
from numba.extending import intrinsic

from rheoplan.kernels.linear.cpu import _widen, bfloat16_bits as _round

@intrinsic
def _bits_at(typingctx, address):
    """``address`` (an integer, a tensor's ``data_ptr``) as a pointer to 16-bit entries."""
    sig = types.CPointer(types.uint16)(types.intp)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], llvm_ir.PointerType(llvm_ir.IntType(16)))
    return sig, codegen


#: torch's reduction of a contiguous float32 row (``aten/src/ATen/native/cpu/SumKernel.cpp``:
#: ``vectorized_inner_sum``, ``row_sum``, ``multi_row_sum``): vectors of ``lanes`` floats,
#: four at a time in four accumulators, each kept in a cascade of four levels of 16 steps
_ILP = 4
_LEVELS = 4
_LEVEL_POWER = 4


@njit(inline="always")
def _add_group(x, i, lanes, acc):
    """``acc[0, k] += (vector 4i + k of x)^2`` lane by lane, ``k < 4``: one step of torch's
    ``multi_row_sum`` over the row's vectors of ``lanes`` floats."""
    for k in range(_ILP):
        base = (i * _ILP + k) * lanes
        for m in range(lanes):
            v = _widen(x[base + m])
            acc[0, k, m] += v * v


@njit(inline="always")
def _sum_of_squares(x, lanes):
    """sum(x[j]^2) over one row of bfloat16 bits, each square rounded to float32 (torch's
    ``pow(2)``), summed in the order of torch's CPU ``sum`` over a contiguous float32 row
    read in vectors of ``lanes`` floats (``summation_lanes``): every level of its cascade
    written out, so the sum is ``x.float().pow(2).sum(-1)``'s bits."""
    n = x.shape[0]
    vec_size = n // lanes
    size = vec_size // _ILP
    acc = np.zeros((_LEVELS, _ILP, lanes), np.float32)
    step = 1 << _LEVEL_POWER
    i = 0
    while i + step <= size:
        for _ in range(step):
            _add_group(x, i, lanes, acc)
            i += 1
        for j in range(1, _LEVELS):
            for k in range(_ILP):
                for m in range(lanes):
                    acc[j, k, m] += acc[j - 1, k, m]
                    acc[j - 1, k, m] = np.float32(0.0)
            if i & ((step - 1) << (j * _LEVEL_POWER)) != 0:
                break
    while i < size:
        _add_group(x, i, lanes, acc)
        i += 1
    for j in range(1, _LEVELS):
        for k in range(_ILP):
            for m in range(lanes):
                acc[0, k, m] += acc[j, k, m]
    for i in range(size * _ILP, vec_size):  # vectors left over from the groups of four
        for m in range(lanes):
            v = _widen(x[i * lanes + m])
            acc[0, 0, m] += v * v
    for k in range(1, _ILP):
        for m in range(lanes):
            acc[0, 0, m] += acc[0, k, m]
    total = np.float32(0.0)
    for j in range(vec_size * lanes, n):  # the tail past the last whole vector
        v = _widen(x[j])
        total += v * v
    for m in range(lanes):
        total += acc[0, 0, m]
    return total


@njit(cache=True)
def _sums_of_squares(x, lanes, out):
    """``out[r] = _sum_of_squares(x[r], lanes)`` (bfloat16 bits ``x [rows, n]``): what
    ``summation_lanes`` compares with torch's sums."""
    for r in range(x.shape[0]):
        out[r] = _sum_of_squares(x[r], lanes)


#: the vector widths ``summation_lanes`` tries (AVX2's and AVX-512's floats per vector)
LANE_CANDIDATES = (8, 16)


@functools.lru_cache(maxsize=1)
def summation_lanes() -> int | None:
    """The vector width (floats) with which ``_sum_of_squares`` gives torch's sums here, found
    by comparing both with torch on rows built to tell the orders apart (widths up to a few
    thousand, outliers a thousand times the rest; 96 rows, a few ms once per process); None
    where neither matches, and the norms keep torch's operators. Measured, not read from
    the CPU's flags: on the Zen 4 AMD EPYC torch reports AVX-512 yet sums in vectors of 8."""
    g = torch.Generator().manual_seed(0)
    rows = []
    for width in (64, 576, 600, 4136):
        x = torch.randn(24, width, generator=g) * 4
        x[torch.rand(24, width, generator=g) < 0.02] *= 1000
        rows.append(x.to(torch.bfloat16))
    for lanes in LANE_CANDIDATES:
        if all(_matches(x, lanes) for x in rows):
            return lanes
    return None


def _matches(x: torch.Tensor, lanes: int) -> bool:
    want = x.float().pow(2).sum(-1)
    got = np.empty(x.shape[0], np.float32)
    _sums_of_squares(x.view(torch.int16).numpy().view(np.uint16), lanes, got)
    return bool(torch.equal(torch.from_numpy(got), want))


@njit(inline="always")
def _norm_row(x, w, eps, lanes, out):
    """``out = w * bf16(x * rsqrt(sum(x^2) / H + eps))`` for one row of bfloat16 bits, each
    step rounded as torch's operators round (``LlamaRMSNorm.forward``: the mean is a sum,
    then a division)."""
    H = x.shape[0]
    inv = np.float32(1.0) / np.sqrt(_sum_of_squares(x, lanes) / np.float32(H) + np.float32(eps))
    for j in range(H):
        out[j] = _round(_widen(w[j]) * _widen(_round(_widen(x[j]) * inv)))


@njit(cache=True)
def _rms_norm(x_at, x_stride, rows, H, w_at, eps, lanes, out_at):
    x = carray(_bits_at(x_at), ((rows - 1) * x_stride + H,))
    w = carray(_bits_at(w_at), (H,))
    out = carray(_bits_at(out_at), (rows * H,))
    for r in range(rows):
        _norm_row(x[r * x_stride:r * x_stride + H], w, eps, lanes, out[r * H:(r + 1) * H])


@njit(cache=True)
def _add_rms_norm(h_at, d_at, d_stride, rows, H, w_at, eps, lanes, sum_at, out_at):
    h = carray(_bits_at(h_at), (rows * H,))
    d = carray(_bits_at(d_at), ((rows - 1) * d_stride + H,))
    w = carray(_bits_at(w_at), (H,))
    s = carray(_bits_at(sum_at), (rows * H,))
    out = carray(_bits_at(out_at), (rows * H,))
    for r in range(rows):
        sr = s[r * H:(r + 1) * H]
        for j in range(H):
            sr[j] = _round(_widen(h[r * H + j]) + _widen(d[r * d_stride + j]))
        _norm_row(sr, w, eps, lanes, out[r * H:(r + 1) * H])


@njit(inline="always")
def _rope_head(xr, cr, sr, o, half, D):
    """``o = xr * cr + roll(xr, half) * sr`` for one head of ``D`` entries (bfloat16 bits),
    each product and the sum rounded: ``reference.rope``'s operations on one head."""
    for j in range(half):
        o[j] = _round(_widen(_round(_widen(xr[j]) * _widen(cr[j])))
                      + _widen(_round(_widen(xr[j + half]) * _widen(sr[j]))))
    for j in range(half, D):
        o[j] = _round(_widen(_round(_widen(xr[j]) * _widen(cr[j])))
                      + _widen(_round(_widen(xr[j - half]) * _widen(sr[j]))))


@njit(cache=True)
def _rope(x_at, x_stride, rows, W, cos_at, sin_at, D, out_at):
    x = carray(_bits_at(x_at), ((rows - 1) * x_stride + W,))
    c = carray(_bits_at(cos_at), (rows * D,))
    s = carray(_bits_at(sin_at), (rows * D,))
    out = carray(_bits_at(out_at), (rows * W,))
    half = D // 2
    for r in range(rows):
        cr = c[r * D:(r + 1) * D]
        sr = s[r * D:(r + 1) * D]
        for h0 in range(0, W, D):
            _rope_head(x[r * x_stride + h0:r * x_stride + h0 + D], cr, sr, out[r * W + h0:r * W + h0 + D], half, D)


@njit(cache=True)
def _rope_qkv_append(qkv_at, stride, batch, tokens, n_q, n_kv, D, cos_at, sin_at, q_out_at, k_buf_at, v_buf_at,
                     buf_size, buf_b, buf_h, buf_t, at):
    """``_rope`` of the queries into ``q_out`` and of the keys into the key buffer, the values
    copied into the value buffer. Row ``r = b * tokens + t`` of the q | k | v product (rows
    ``stride`` apart; ``n_q`` query heads, then ``n_kv`` key heads, then ``n_kv`` value
    heads of ``D`` entries) goes to buffer entries ``[b, head, at + t]`` (strides ``buf_b``,
    ``buf_h``, ``buf_t``; the ``D`` entries contiguous)."""
    rows = batch * tokens
    wq, wk = n_q * D, n_kv * D
    x = carray(_bits_at(qkv_at), ((rows - 1) * stride + wq + 2 * wk,))
    c = carray(_bits_at(cos_at), (rows * D,))
    s = carray(_bits_at(sin_at), (rows * D,))
    qo = carray(_bits_at(q_out_at), (rows * wq,))
    kb = carray(_bits_at(k_buf_at), (buf_size,))
    vb = carray(_bits_at(v_buf_at), (buf_size,))
    half = D // 2
    for r in range(rows):
        b = r // tokens
        t = r - b * tokens
        cr = c[r * D:(r + 1) * D]
        sr = s[r * D:(r + 1) * D]
        row = r * stride
        for h in range(n_q):
            src = row + h * D
            _rope_head(x[src:src + D], cr, sr, qo[r * wq + h * D:r * wq + (h + 1) * D], half, D)
        for h in range(n_kv):
            dst = b * buf_b + h * buf_h + (at + t) * buf_t
            src = row + wq + h * D
            _rope_head(x[src:src + D], cr, sr, kb[dst:dst + D], half, D)
            src += wk
            for j in range(D):
                vb[dst + j] = x[src + j]


def row_stride(x: torch.Tensor) -> int | None:
    """The stride between consecutive rows of ``x`` read as ``[rows, x.shape[-1]]`` (its
    leading axes merged), or None where no single stride spans them or the last axis is
    not contiguous. Plain Python on the shape: a ``view`` to find it cost more than the
    kernels' arithmetic."""
    if x.is_contiguous():  # the common case (a hidden state, a product's whole output)
        return x.shape[-1] if x.dim() else None
    shape, strides = x.shape, x.stride()
    if not shape or (shape[-1] > 1 and strides[-1] != 1):
        return None
    stride = expect = None
    for size, st in zip(reversed(shape[:-1]), reversed(strides[:-1])):
        if size == 1:
            continue
        if stride is None:
            stride = st
        elif st != expect:
            return None
        expect = st * size
    return shape[-1] if stride is None else stride


def norm_applies() -> bool:
    """Whether the norm kernels sum as torch does here (``summation_lanes``)."""
    return summation_lanes() is not None


def applies(*tensors: torch.Tensor) -> bool:
    """Whether the kernels take these tensors: bfloat16 on the CPU."""
    return all(t.dtype == torch.bfloat16 and t.is_cpu for t in tensors)


def rms_norm(x: torch.Tensor, x_stride: int, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``reference.rms_norm`` of ``x`` (rows ``x_stride`` apart, ``row_stride``) by a
    contiguous ``weight``."""
    H = x.shape[-1]
    rows = x.numel() // H
    out = torch.empty(x.shape, dtype=x.dtype)
    if rows:
        _rms_norm(x.data_ptr(), x_stride, rows, H, weight.data_ptr(), eps, summation_lanes(), out.data_ptr())
    return out


def add_rms_norm(hidden: torch.Tensor, delta: torch.Tensor, d_stride: int, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``reference.add_rms_norm`` of a contiguous ``hidden`` and ``delta`` of its shape
    (rows ``d_stride`` apart) by a contiguous ``weight``."""
    H = hidden.shape[-1]
    rows = hidden.numel() // H
    total = torch.empty(hidden.shape, dtype=hidden.dtype)
    out = torch.empty(hidden.shape, dtype=hidden.dtype)
    if rows:
        _add_rms_norm(hidden.data_ptr(), delta.data_ptr(), d_stride, rows, H, weight.data_ptr(), eps,
                      summation_lanes(), total.data_ptr(), out.data_ptr())
    return total, out


def rope(x: torch.Tensor, x_stride: int, cos: torch.Tensor, signed_sin: torch.Tensor,
         head_dim: int) -> torch.Tensor:
    """``reference.rope`` of ``x`` (rows ``x_stride`` apart) by contiguous ``cos`` and
    ``signed_sin`` of ``x``'s rows."""
    W = x.shape[-1]
    rows = x.numel() // W
    out = torch.empty(x.shape, dtype=x.dtype)
    if rows:
        _rope(x.data_ptr(), x_stride, rows, W, cos.data_ptr(), signed_sin.data_ptr(), head_dim, out.data_ptr())
    return out


def rope_qkv_append(qkv: torch.Tensor, qkv_stride: int, q_heads: int, cos: torch.Tensor, signed_sin: torch.Tensor,
                    head_dim: int, key_buf: torch.Tensor, value_buf: torch.Tensor, at: int) -> torch.Tensor:
    """``reference.rope_qkv_append`` for ``qkv [B, T, ...]`` with rows ``qkv_stride`` apart
    (``row_stride``), contiguous angles ``[B, T, head_dim]`` and contiguous buffers of one
    shape."""
    batch, tokens = qkv.shape[0], qkv.shape[1]
    kv_heads = key_buf.shape[1]
    out = torch.empty((batch, tokens, q_heads * head_dim), dtype=qkv.dtype)
    if batch * tokens:
        sb, sh, st, _ = key_buf.stride()
        _rope_qkv_append(qkv.data_ptr(), qkv_stride, batch, tokens, q_heads, kv_heads, head_dim, cos.data_ptr(),
                         signed_sin.data_ptr(), out.data_ptr(), key_buf.data_ptr(), value_buf.data_ptr(),
                         key_buf.numel(), sb, sh, st, at)
    return out
