"""numba CPU path of the few-row linear product (same signature as ``reference.linear``).

Why: at decode time a target forward multiplies 1 to 32 rows by each weight matrix. On a
2-core AVX2-only AMD EPYC (no AVX-512), torch's float32 products (MKL's, and oneDNN's
packed ones alike) cost twice as much for 2 rows as for 1: the 1536 x 576 MLP matrix took
93 / 228 / 256 us at 1 / 2 / 4 rows, and a SmolLM2-135M forward of 2 tokens 88 ms against
57 for one, so every drafted node was dear. This kernel reads each weight row once for
all input rows (two input rows per pass over it) and splits the output columns over the
threads: the decoder stack's 210 matrices, one product each, took 29 / 37 / 58 ms at 8 /
16 / 32 rows against torch's 49 / 59 / 76 (docs/results.md, "Few-row products" and its
second round). Whether it pays is measured on the model
(``rheoplan.models.packed_linear.few_rows_span``), not read from CPU flags.

Rounding: each output is one dot product summed in a fixed order (the vectorised
reduction ``reassoc`` allows), the same order whatever the other rows and whatever the
number of threads, so a token's product does not depend on the rows beside it (a 9-token
tree forward and a 1-token step agree bit for bit in these products, which torch's do
not promise). Against torch's product it differs by float32 rounding (about 1e-6
relative). Only ``reassoc`` and ``contract`` (FMA) are allowed: NaN and infinities
propagate as in torch's product.

bfloat16: activations and weight are widened to float32 (exactly: a bfloat16 is the upper
half of a float32), summed by the same loop in float32, and the result rounded to bfloat16
once, as torch's bfloat16 product does; the weight is read as 16 bits, half the bytes. A
row's sums are then the float32 kernel's bits on the widened operands. Without AVX-512,
torch's own bfloat16 products are slow and grow with the rows (the 210 matrices took 12 /
88 / 349 ms at 1 / 8 / 32 rows on the AVX2-only AMD EPYC, the kernel 11 / 18 / 47)."""

from __future__ import annotations

import numpy as np
import torch
from llvmlite import ir as llvm_ir
from numba import njit, prange
from numba.core import types
from numba.extending import intrinsic, overload

from rheoplan.kernels import parallel

#: rows up to which ``linear`` runs the kernel; more rows (a prompt's prefill) go to torch,
#: whose blocked float32 products win there (on the AVX2-only AMD EPYC, a forward's matrices
#: took 58 ms through the kernel against torch's 76 at 32 rows, 88 against 107 at 48, tied
#: at 64); its bfloat16 products there never do (``PackedLinear(prefill=True)``)
MAX_ROWS = 32

#: this kernel's blocking, part of the keys of the caches that hold timings made with it
#: (``rheoplan.loading.speed_tag``, the dtype probes): a record timed with another version
#: of the kernel is measured again
VERSION = f"rows in pairs, a lone row by eights, at most {MAX_ROWS}, float32 and bfloat16"

_FAST = {"reassoc", "contract"}

@intrinsic
def _bfloat16_bits_to_float32(typingctx, bits):
    """The float32 whose upper half is ``bits`` (a bfloat16's 16 bits): exact, as torch's
    ``.float()`` of a bfloat16; LLVM vectorises it to a widening load and a shift."""
    sig = types.float32(types.uint16)

    def codegen(context, builder, signature, args):
        wide = builder.zext(args[0], llvm_ir.IntType(32))
        return builder.bitcast(builder.shl(wide, llvm_ir.Constant(llvm_ir.IntType(32), 16)), llvm_ir.FloatType())
    return sig, codegen


def _widen(v):
    """A weight element as float32: itself (float32 weights) or its bfloat16 bits widened
    (``np.uint16``). Python's version; numba compiles ``_widen_impl``'s."""
    if isinstance(v, np.uint16):
        return np.array(np.uint32(v) << np.uint32(16), np.uint32).view(np.float32)[()]
    return v


@overload(_widen, inline="always")
def _widen_impl(v):
    if v == types.float32:
        return lambda v: v
    if v == types.uint16:
        return lambda v: _bfloat16_bits_to_float32(v)
    return None


@intrinsic
def _float32_bits(typingctx, f):
    """The 32 bits of the float32 ``f``."""
    sig = types.uint32(types.float32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], llvm_ir.IntType(32))
    return sig, codegen


@njit(inline="always")
def _rounded_bfloat16_bits(bits):
    """The bfloat16 nearest the float32 of ``bits`` (uint32, not a NaN), ties to even: the
    rounding of torch's float -> bfloat16 conversion (c10's ``round_to_nearest_even``);
    infinities stay, overflow rounds to them. No sum overflows 32 bits: the largest
    non-NaN pattern, 0xFF800000, plus 0x8000 stays below 2**32."""
    return np.uint16((bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))


#: the bfloat16 pattern every NaN becomes (c10's scalar conversion's; torch's vectorised one
#: writes 0xFFFF, another NaN)
_BFLOAT16_NAN = 0x7FC0


def _narrow(out, v):
    """A float32 sum as ``out`` stores it: itself (a float32 ``out``), or rounded to
    bfloat16 bits (a uint16 ``out``). Python's version; numba compiles ``_narrow_impl``'s."""
    if out.dtype != np.uint16:
        return v
    if v != v:
        return np.uint16(_BFLOAT16_NAN)
    return _rounded_bfloat16_bits(np.float32(v).view(np.uint32))


@njit(inline="always")
def bfloat16_bits(v):
    """The float32 ``v`` as the bits of the bfloat16 torch rounds it to: nearest, ties to
    even, every NaN ``_BFLOAT16_NAN`` (the kernels' one rounding to bfloat16; also
    ``rheoplan.kernels.decoder_glue.cpu``'s)."""
    # rounded first, then chosen: a select, not a branch, so LLVM vectorises the loops this
    # is inlined in (the decoder glue's norms 1.6x faster on the AVX2-only AMD EPYC, the
    # same bits; docs/results.md, "Fortieth round"). A NaN's rounding is discarded.
    rounded = _rounded_bfloat16_bits(_float32_bits(np.float32(v)))
    return np.uint16(_BFLOAT16_NAN) if v != v else rounded


# Not ``inline="always"`` as ``_widen``: numba 0.68's IR inlining of this overload (a lambda
# calling an inlined function) printed 66 NumbaIRAssumptionWarnings to a user's terminal on
# the first compile (stderr of a first ``rheoplan generate``); compiled as a function, LLVM
# inlines it: the same bits, the same time (paired on the AVX2-only AMD EPYC, 1-8 rows).
@overload(_narrow)
def _narrow_impl(out, v):
    if out.dtype == types.float32:
        return lambda out, v: v
    if out.dtype == types.uint16:
        return lambda out, v: bfloat16_bits(v)
    return None


@njit(inline="always", fastmath=_FAST)
def _pair_times_four(x, i, i1, w, q, out, j):
    """``out[i | i1, j:j+4] = x[i | i1] . w[q:q+4]``: the kernels' main loop, eight
    accumulators (four weight rows x two input rows), so each weight element loaded serves
    two rows. Every row of a product of two or more rows goes through this loop (an odd
    last row paired with itself), a lone row through ``_row_times_eight``, which sums in
    the same order; so a row's sums are the same bits whatever rows are beside it and
    whatever the weight's dtype (tests/kernels/linear)."""
    a0 = np.float32(0.0)
    a1 = np.float32(0.0)
    a2 = np.float32(0.0)
    a3 = np.float32(0.0)
    b0 = np.float32(0.0)
    b1 = np.float32(0.0)
    b2 = np.float32(0.0)
    b3 = np.float32(0.0)
    for k in range(x.shape[1]):
        u = x[i, k]
        v = x[i1, k]
        w0 = _widen(w[q, k])
        w1 = _widen(w[q + 1, k])
        w2 = _widen(w[q + 2, k])
        w3 = _widen(w[q + 3, k])
        a0 += u * w0
        a1 += u * w1
        a2 += u * w2
        a3 += u * w3
        b0 += v * w0
        b1 += v * w1
        b2 += v * w2
        b3 += v * w3
    out[i, j] = _narrow(out, a0)
    out[i, j + 1] = _narrow(out, a1)
    out[i, j + 2] = _narrow(out, a2)
    out[i, j + 3] = _narrow(out, a3)
    out[i1, j] = _narrow(out, b0)
    out[i1, j + 1] = _narrow(out, b1)
    out[i1, j + 2] = _narrow(out, b2)
    out[i1, j + 3] = _narrow(out, b3)


@njit(inline="always", fastmath=_FAST)
def _row_times_eight(x, i, w, q, out, j):
    """``out[i, j:j+8] = x[i] . w[q:q+8]``: a lone input row against eight weight rows, eight
    accumulators. Why: ``_pair_times_four`` with a row paired with itself does every
    multiply twice; a one-row product (a ``generate`` step, a draft head call, one node's
    output projection) now does each once (bfloat16 on the AVX2-only AMD EPYC: SmolLM2's
    49152 x 576 output projection 2.98 -> 2.50 ms, the model's 211 matrices in turn
    17.9 -> 15.9 ms; docs/results.md, "A lone row by eights"). Each accumulator is summed
    in the same order as in ``_pair_times_four`` (LLVM vectorises both loops alike: one
    vector lane per ``k`` modulo the vector width, the same final reduction), so a row's
    bits do not depend on whether it came alone (``tests/kernels/linear`` holds it to that,
    compiler and all)."""
    a0 = np.float32(0.0)
    a1 = np.float32(0.0)
    a2 = np.float32(0.0)
    a3 = np.float32(0.0)
    a4 = np.float32(0.0)
    a5 = np.float32(0.0)
    a6 = np.float32(0.0)
    a7 = np.float32(0.0)
    for k in range(x.shape[1]):
        u = x[i, k]
        a0 += u * _widen(w[q, k])
        a1 += u * _widen(w[q + 1, k])
        a2 += u * _widen(w[q + 2, k])
        a3 += u * _widen(w[q + 3, k])
        a4 += u * _widen(w[q + 4, k])
        a5 += u * _widen(w[q + 5, k])
        a6 += u * _widen(w[q + 6, k])
        a7 += u * _widen(w[q + 7, k])
    out[i, j] = _narrow(out, a0)
    out[i, j + 1] = _narrow(out, a1)
    out[i, j + 2] = _narrow(out, a2)
    out[i, j + 3] = _narrow(out, a3)
    out[i, j + 4] = _narrow(out, a4)
    out[i, j + 5] = _narrow(out, a5)
    out[i, j + 6] = _narrow(out, a6)
    out[i, j + 7] = _narrow(out, a7)


@njit(inline="always", fastmath=_FAST)
def _lone_row(x, w, out, jb):
    """Block ``jb`` of eight weight rows for a one-row ``x``: ``_row_times_eight``, or at
    the end of ``w`` a block of four (``_pair_times_four``, the row paired with itself) and
    the last 1-3 rows (``_last_rows``), as the paired loops do them."""
    j = jb * 8
    n = w.shape[0]
    if j + 8 <= n:
        _row_times_eight(x, 0, w, j, out, j)
        return
    if j + 4 <= n:
        _pair_times_four(x, 0, 0, w, j, out, j)
        j += 4
    _last_rows(x, w, out, j)


@njit(inline="always", fastmath=_FAST)
def _last_rows(x, w, out, j):
    """The last 1-3 weight rows (from ``j``), one dot product at a time."""
    for jj in range(j, w.shape[0]):
        for i in range(x.shape[0]):
            a = np.float32(0.0)
            for k in range(x.shape[1]):
                a += x[i, k] * _widen(w[jj, k])
            out[i, jj] = _narrow(out, a)


@njit(parallel=True, fastmath=_FAST, cache=True)
def _rows_times_weight(x, w, out):
    """``out[i, j] = sum_k x[i, k] * w[j, k]`` for float32 ``x [r, K]``, ``w [N, K]`` (both
    C-contiguous): blocks of four weight rows, each read once for all ``r`` rows, input
    rows two at a time (``_pair_times_four``; at 8 and 16 rows a forward's matrices and its
    output projection took 36 / 47 ms against 42 / 63 one row at a time); a lone row in
    blocks of eight weight rows (``_lone_row``)."""
    r = x.shape[0]
    n = w.shape[0]
    if r == 1:
        for jb in prange((n + 7) // 8):
            _lone_row(x, w, out, jb)
        return
    for jb in prange((n + 3) // 4):
        j = jb * 4
        if j + 4 <= n:
            for i in range(0, r, 2):
                _pair_times_four(x, i, i + 1 if i + 1 < r else i, w, j, out, j)
        else:
            _last_rows(x, w, out, j)


@njit(parallel=True, fastmath=_FAST, cache=True)
def _rows_times_bfloat16_weight(x_bits, w, out, shares):
    """``_rows_times_weight`` for bfloat16 operands (``x [r, K]`` and ``w [N, K]`` their
    uint16 bits), each element widened to float32 (exactly) and summed in float32: the
    float32 kernel's bits on the widened operands, stored in ``out`` as float32 or (a
    uint16 ``out``) rounded to bfloat16 bits as torch rounds. Widening and rounding in here,
    not by torch around the call, saves two torch calls per product (with the shapes kept in
    numpy, a bfloat16 ``PackedLinear`` call 26.7 -> 19.4 us). Half the bytes to read, so
    one row costs about two thirds of the float32 kernel's (the decoder stack's 210
    matrices, 1 row: 10.7 against 16.9 ms on the AVX2-only AMD EPYC).
    Beyond two rows a block of four weight rows is widened once into a float32 buffer of
    its thread, not once per pair of rows (16 rows: 28.0 against 37.2 ms); a lone row runs
    in blocks of eight weight rows straight from the 16-bit weight (``_lone_row``). The columns are
    split in ``shares`` contiguous shares (one per thread), one buffer each (the caller
    passes the thread count: asking numba for it in here would keep the function out of
    numba's on-disk cache)."""
    r, k_len = x_bits.shape
    x = np.empty((r, k_len), np.float32)
    for i in range(r):
        for k in range(k_len):
            x[i, k] = _bfloat16_bits_to_float32(x_bits[i, k])
    n = w.shape[0]
    if r == 1:
        blocks = (n + 7) // 8
        per = (blocks + shares - 1) // shares
        for t in prange(shares):
            for jb in range(t * per, min(blocks, (t + 1) * per)):
                _lone_row(x, w, out, jb)
        return
    blocks = (n + 3) // 4
    per = (blocks + shares - 1) // shares
    for t in prange(shares):
        buf = np.empty((4, k_len), np.float32)
        for jb in range(t * per, min(blocks, (t + 1) * per)):
            j = jb * 4
            if j + 4 > n:
                _last_rows(x, w, out, j)
            elif r <= 2:
                _pair_times_four(x, 0, r - 1, w, j, out, j)
            else:
                for q in range(4):
                    for k in range(k_len):
                        buf[q, k] = _bfloat16_bits_to_float32(w[j + q, k])
                for i in range(0, r, 2):
                    _pair_times_four(x, i, i + 1 if i + 1 < r else i, buf, 0, out, j)


#: the dtypes the kernel multiplies (activations and weight in the same dtype); bfloat16
#: is summed in float32 and rounded once at the end, as torch's bfloat16 product does
DTYPES = (torch.float32, torch.bfloat16)


def rows_served(x: torch.Tensor, weight: torch.Tensor, most: int = MAX_ROWS) -> int:
    """How many rows of ``x`` the kernel multiplies by ``weight [N, K]``: all of them when
    ``x`` is float32 or bfloat16 (``DTYPES``) on the CPU with ``K`` features, 1 to
    ``most`` rows (a prompt's prefill too where the caller measured the kernel faster
    there: ``PackedLinear(prefill=True)``), and no gradient is asked of the product (``x``
    does not require one, nor ``weight`` while autograd records); else 0 (torch's
    product). The weight's own dtype and device are ``supported``'s to check
    (``PackedLinear`` fixes them when it is built, and calls this on every product)."""
    k = weight.shape[1]
    if x.dtype not in DTYPES or x.shape[-1] != k or k == 0 or not x.is_cpu or x.requires_grad:
        return 0
    rows = x.numel() // k
    if not 0 < rows <= most or (weight.requires_grad and torch.is_grad_enabled()):
        return 0
    return rows


def supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``linear`` runs the kernel for these operands (both float32 or both bfloat16,
    on the CPU, at most ``MAX_ROWS`` rows, no autograd: ``rows_served``); otherwise it runs
    torch's product."""
    return (weight.dtype == x.dtype and weight.device.type == "cpu" and rows_served(x, weight) > 0)


def weight_array(weight: torch.Tensor) -> np.ndarray:
    """``weight [N, K]`` as the kernel reads it: a C-contiguous numpy array, float32 or (for
    a bfloat16 weight) its uint16 bits; a view of the tensor where it is contiguous (so
    changes in place reach the kernel), else a copy."""
    w = weight.detach().contiguous()
    if w.dtype == torch.bfloat16:
        return w.view(torch.int16).numpy().view(np.uint16)
    return w.numpy()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., K]``, ``weight [N, K]``, ``bias [N]`` or None -> ``[..., N]``: the kernel
    where ``supported``, torch's product elsewhere."""
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x has {x.shape[-1]} features but weight is {tuple(weight.shape)}")
    if not supported(x, weight):
        return torch.nn.functional.linear(x, weight, bias)
    return rows_times(x, weight_array(weight), bias)


def rows_times(x: torch.Tensor, w: np.ndarray, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., K] @ w.T (+ bias)`` -> ``[..., N]`` for ``x`` as ``rows_served`` serves it
    and ``w`` a ``weight_array`` of the same dtype, without ``linear``'s checks and
    conversions: the hot path of ``PackedLinear``, which holds ``w`` and checks
    ``rows_served`` once per call. Shapes are handled as numpy views, not torch calls (a
    torch ``reshape`` or ``view`` costs 2-3 us, a forward makes 211 products: the path
    through ``linear`` once cost 26 us per call around a 2-4 us launch; docs/results.md).
    In bfloat16 the sums (and a bias) are float32 and the result is rounded to bfloat16
    once, as torch's bfloat16 product rounds."""
    bf16 = w.dtype == np.uint16  # bfloat16: the kernel reads and writes the 16-bit patterns
    xn = x.view(torch.int16).numpy().view(np.uint16) if bf16 else x.numpy()
    if not xn.flags.c_contiguous:
        xn = np.ascontiguousarray(xn)
    rounded = bf16 and bias is None  # with a bias the sums come back as float32, rounded after it
    out = np.empty(xn.shape[:-1] + (w.shape[0],), np.uint16 if rounded else np.float32)
    x2, out2 = xn.reshape(-1, xn.shape[-1]), out.reshape(-1, w.shape[0])
    if bf16:
        bfloat16_rows_into(x2, w, out2)
    else:
        parallel.launch(_rows_times_weight, x2, w, out2)
    y = torch.from_numpy(out)
    if rounded:
        return y.view(torch.bfloat16)
    if bias is not None:
        y += bias
    return y.to(torch.bfloat16) if bf16 else y


def bfloat16_rows_into(x: np.ndarray, w: np.ndarray, out: np.ndarray) -> None:
    """``out = x @ w.T`` for the bits of bfloat16 operands, each sum rounded to bfloat16 as
    ``rows_times`` rounds it: ``x [r, K]`` and ``out [r, N]`` C-contiguous uint16 arrays,
    ``w [N, K]`` a bfloat16 ``weight_array``, ``r >= 1`` (not checked). The
    kernel call alone, on ``parallel.threads()`` threads, the same bits as ``rows_times``.

    Why: ``rows_times`` wraps a 2-4 us launch in ~11 us of conversions (the input's numpy
    view, the output's allocation, a tensor made of it), ``PackedLinear.forward`` adds its
    checks; a caller that keeps its operands as arrays, the output one it reuses
    (``rheoplan.models.lean_llama``'s products), pays the launch alone."""
    parallel.launch(_rows_times_bfloat16_weight, x, w, out, parallel.threads())
