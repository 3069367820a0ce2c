"""Triton slot-expansion kernels (same signature as ``reference.slot_expansion``).

The exact top-S of each row's draft law q, then tail mass, proxy, tail law, the Gumbel-max
draw from the injected noise, and the K children. The top-S is a radix select on the
float32 bit pattern of q (monotone for q >= 0) for the S-th largest value (three digits,
one histogram pass each), a compaction (entries above it, then the lowest ids equal to
it, in id order) and a ranking of the S candidates by pairwise comparison (q desc, id asc).

The vocabulary is split across programs when the rows alone leave the GPU idle (a few
rows at batch 1; readiness item 8): grid rows x chunks.

1. ``softmax_partials_kernel`` (logits only): each chunk's max and sum of exp.
2. ``chunk_topk_kernel``: each chunk's own top-S by the select above, over q from the
   combined statistics, written in id order to a ``[rows, chunks * S]`` scratch (q = -1
   pads a chunk with fewer than S entries). The row's top-S is inside the union of the
   chunks' (an entry beaten by fewer than S entries of the row is beaten by fewer than S
   of its chunk), and the scratch is in id order, so the same select over it keeps the
   same lowest ids among ties.
3. ``slot_expansion_kernel`` (one program per row): that select over the scratch (or,
   unsplit, over the whole vocabulary: one launch, statistics in the kernel), the ranking
   and everything after it.

Float parity: q comes from Triton's exp, not torch's, so q and scores match the
reference to ~1e-6 relative, not bitwise (and, from logits, depend on the chunk count in
the last bit: the statistics are summed per chunk); tokens match exactly unless two
distinct logits give q values within that rounding (never in the tests). From a given
law (``probs=True``, what the planner passes) every output is independent of the split:
the select is exact and q is copied, not recomputed.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from rheoplan.kernels.slot_expansion.reference import PROXY_CODES, SlotExpansion, check_args


@triton.jit
def _q_block(q_ptr, base, offs, hi, INV_T, mx, ssum, PROBS: tl.constexpr):
    """q at ``offs`` of the row starting at ``base`` (``-1`` past ``hi``: padding)."""
    x = tl.load(q_ptr + base + offs, mask=offs < hi, other=float("-inf")).to(tl.float32)
    if PROBS:  # the input already is the law (the planner's, or a chunk scratch: -1 = padding)
        return tl.where(offs < hi, x, -1.0)
    return tl.where(offs < hi, tl.exp(x * INV_T - mx) / ssum, -1.0)  # -1 marks padding


@triton.jit
def _lane_stats(logits_ptr, base, lo, hi, INV_T, BLOCK: tl.constexpr):
    """Max and sum of exp(x / T - max) over ``[lo, hi)`` of a row: per-lane running values,
    reduced once after the loop (one cross-warp reduction instead of two per block). A lane
    that has seen only -inf keeps max -inf; ``safe`` keeps exp(-inf - -inf) = NaN out of
    its sum (item 7). Returns (max, possibly -inf; sum relative to max, 0 if -inf)."""
    offs0 = tl.arange(0, BLOCK)
    mx_v = tl.full([BLOCK], float("-inf"), tl.float32)
    s_v = tl.zeros([BLOCK], tl.float32)
    for start in range(lo, hi, BLOCK):
        offs = start + offs0
        x = tl.load(logits_ptr + base + offs, mask=offs < hi, other=float("-inf")).to(tl.float32) * INV_T
        new_mx = tl.maximum(mx_v, x)
        safe = tl.where(new_mx == float("-inf"), 0.0, new_mx)
        s_v = s_v * tl.exp(mx_v - safe) + tl.exp(x - safe)
        mx_v = new_mx
    mx = tl.max(mx_v, axis=0)
    mx_safe = tl.where(mx == float("-inf"), 0.0, mx)
    return mx, tl.sum(s_v * tl.exp(mx_v - mx_safe), axis=0)


@triton.jit
def _radix_digit(q_ptr, base, lo, hi, INV_T, mx, ssum, prefix, above, SHIFT: tl.constexpr,
                 WIDTH: tl.constexpr, S: tl.constexpr, BLOCK: tl.constexpr, PROBS: tl.constexpr):
    """One digit (bits ``SHIFT .. SHIFT + WIDTH - 1``) of the S-th largest bit pattern in
    ``[lo, hi)``: among the entries whose higher digits equal ``prefix``'s, the largest
    digit d with ``above + #{digit >= d} >= S`` (0 if none, as the bit search: fewer than S
    entries give t = 0). Returns (prefix with that digit, above + #{digit > d})."""
    NBINS: tl.constexpr = 1 << WIDTH
    offs0 = tl.arange(0, BLOCK)
    hist = tl.zeros([2 * NBINS], tl.int32)
    for start in range(lo, hi, BLOCK):
        q = _q_block(q_ptr, base, start + offs0, hi, INV_T, mx, ssum, PROBS)
        bits = q.to(tl.int32, bitcast=True)
        same = (q >= 0) & ((bits >> (SHIFT + WIDTH)) == (prefix >> (SHIFT + WIDTH)))
        # entries outside the prefix go to bin NBINS, never read: no masked histogram needed
        hist += tl.histogram(tl.where(same, (bits >> SHIFT) & (NBINS - 1), NBINS), 2 * NBINS)
    b = tl.arange(0, 2 * NBINS)
    cnt = tl.where(b < NBINS, hist, 0)
    at_least = tl.sum(cnt, axis=0) - tl.cumsum(cnt, axis=0) + cnt  # #{digit >= b}
    d = tl.max(tl.where((above + at_least >= S) & (b < NBINS), b, 0), axis=0)
    above = above + tl.sum(tl.where(b > d, cnt, 0), axis=0)
    return prefix | (d << SHIFT), above


@triton.jit
def _select_top(q_ptr, tok_ptr, base, lo, hi, INV_T, mx, ssum, out_tok_ptr, out_q_ptr, out_base,
                S: tl.constexpr, S_BLOCK: tl.constexpr, BLOCK: tl.constexpr, PROBS: tl.constexpr,
                TOKENS: tl.constexpr):
    """The top-S of ``[lo, hi)`` (q desc, lowest ids among ties) written in id order to
    ``out[out_base : out_base + S]``; q = -1 past the entries found. ``TOKENS``: the token of
    an entry is ``tok_ptr[base + offset]`` (a chunk scratch), else the offset itself."""
    # -- S-th largest bit pattern: largest t with #{bits >= t} >= S ----------------------
    # radix select on the 31-bit pattern (q >= 0), three digits of 11, 10, 10 bits: one pass
    # per digit (a histogram of the digit among the entries that share the digits chosen so
    # far), not one pass per bit
    t = tl.full((), 0, tl.int32)
    above = tl.full((), 0, tl.int32)  # entries whose chosen digits are larger than t's
    t, above = _radix_digit(q_ptr, base, lo, hi, INV_T, mx, ssum, t, above, 20, 11, S, BLOCK, PROBS)
    t, above = _radix_digit(q_ptr, base, lo, hi, INV_T, mx, ssum, t, above, 10, 10, S, BLOCK, PROBS)
    t, above = _radix_digit(q_ptr, base, lo, hi, INV_T, mx, ssum, t, above, 0, 10, S, BLOCK, PROBS)
    # -- compaction in id order: all above t, then the first (S - above) equal to t -------
    # (``above`` = #{bits > t}: the radix passes counted it)
    offs0 = tl.arange(0, BLOCK)
    taken = 0
    eq_seen = 0
    for start in range(lo, hi, BLOCK):
        offs = start + offs0
        q = _q_block(q_ptr, base, offs, hi, INV_T, mx, ssum, PROBS)
        bits = q.to(tl.int32, bitcast=True)
        valid = q >= 0
        eq = (bits == t) & valid
        eq_rank = eq_seen + tl.cumsum(eq.to(tl.int32), axis=0) - 1
        sel = ((bits > t) & valid) | (eq & (eq_rank < S - above))
        pos = taken + tl.cumsum(sel.to(tl.int32), axis=0) - 1
        if TOKENS:
            tok = tl.load(tok_ptr + base + offs, mask=sel, other=-1)
        else:
            tok = offs.to(tl.int64)
        # pos < S: an inconsistency between passes must not write into the next row
        tl.store(out_tok_ptr + out_base + pos, tok, mask=sel & (pos < S))
        tl.store(out_q_ptr + out_base + pos, q, mask=sel & (pos < S))
        taken += tl.sum(sel.to(tl.int32), axis=0)
        eq_seen += tl.sum(eq.to(tl.int32), axis=0)
    si = tl.arange(0, S_BLOCK)
    pad = (si >= taken) & (si < S)  # fewer than S entries (a short chunk): invalid rest
    tl.store(out_tok_ptr + out_base + si, tl.full([S_BLOCK], -1, tl.int64), mask=pad)
    tl.store(out_q_ptr + out_base + si, tl.full([S_BLOCK], -1.0, tl.float32), mask=pad)


@triton.jit
def _row_stats(part_mx_ptr, part_s_ptr, row, C, C_BLOCK: tl.constexpr):
    """The row's softmax statistics from its chunks' (``softmax_partials_kernel``)."""
    c = tl.arange(0, C_BLOCK)
    pm = tl.load(part_mx_ptr + row * C + c, mask=c < C, other=float("-inf"))
    ps = tl.load(part_s_ptr + row * C + c, mask=c < C, other=0.0)
    mx = tl.max(pm, axis=0)
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    return mx, tl.sum(ps * tl.exp(pm - mx), axis=0)  # a chunk of -inf only: exp(-inf) * 0


@triton.jit
def softmax_partials_kernel(logits_ptr, part_mx_ptr, part_s_ptr, V, CHUNK, INV_T, BLOCK: tl.constexpr):
    """Grid (rows, chunks): the max and sum of exp of one chunk of one row."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    C = tl.num_programs(1)
    lo = c * CHUNK
    mx, ssum = _lane_stats(logits_ptr, row * V, lo, tl.minimum(lo + CHUNK, V), INV_T, BLOCK)
    tl.store(part_mx_ptr + row * C + c, mx)
    tl.store(part_s_ptr + row * C + c, ssum)


@triton.jit
def chunk_topk_kernel(logits_ptr, part_mx_ptr, part_s_ptr, ctok_ptr, cq_ptr, V, CHUNK, INV_T,
                      S: tl.constexpr, S_BLOCK: tl.constexpr, C_BLOCK: tl.constexpr, BLOCK: tl.constexpr,
                      PROBS: tl.constexpr):
    """Grid (rows, chunks): the top-S of one chunk of one row, in id order, into the row's
    ``[chunks * S]`` scratch at ``chunk * S``."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    C = tl.num_programs(1)
    mx = 0.0
    ssum = 1.0
    if not PROBS:  # every program of the row computes the same statistics (same code, inputs)
        mx, ssum = _row_stats(part_mx_ptr, part_s_ptr, row, C, C_BLOCK)
    lo = c * CHUNK
    _select_top(logits_ptr, logits_ptr, row * V, lo, tl.minimum(lo + CHUNK, V), INV_T, mx, ssum,
                ctok_ptr, cq_ptr, (row * C + c) * S, S, S_BLOCK, BLOCK, PROBS, False)


@triton.jit
def slot_expansion_kernel(logits_ptr, ctok_ptr, cq_ptr, parent_score_ptr, noise_ptr, cand_tok_ptr, cand_q_ptr,
                          sup_token_ptr, sup_q_ptr, z_ptr, y_rank_ptr, y_token_ptr, y_qtilde_ptr,
                          child_token_ptr, child_q_ptr, child_weight_ptr, child_score_ptr,
                          V, NC, noise_stride, INV_T, S: tl.constexpr, S_BLOCK: tl.constexpr,
                          S_TILE: tl.constexpr, M: tl.constexpr, K: tl.constexpr, PROXY: tl.constexpr,
                          BLOCK: tl.constexpr, PROBS: tl.constexpr = False, MERGE: tl.constexpr = False):
    """One program per row. ``MERGE``: the top-S from the chunks' candidates (``NC`` =
    chunks x S entries per row in ``ctok`` / ``cq``); else from the row's V entries."""
    # int64 row: row * V overflows int32 past ~16.7k rows at V = 128k
    row = tl.program_id(0).to(tl.int64)
    if MERGE:
        _select_top(cq_ptr, ctok_ptr, row * NC, 0, NC, INV_T, 0.0, 1.0, cand_tok_ptr, cand_q_ptr, row * S,
                    S, S_BLOCK, BLOCK, True, True)
    else:
        mx = 0.0
        ssum = 1.0
        if not PROBS:  # PROBS: q is given, no softmax statistics needed
            mx, ssum = _lane_stats(logits_ptr, row * V, 0, V, INV_T, BLOCK)
            mx = tl.where(mx == float("-inf"), 0.0, mx)
        _select_top(logits_ptr, logits_ptr, row * V, 0, V, INV_T, mx, ssum, cand_tok_ptr, cand_q_ptr, row * S,
                    S, S_BLOCK, BLOCK, PROBS, False)
    # the candidates are reloaded below by other threads than the ones that stored them
    tl.debug_barrier()
    # -- rank the S candidates: q desc, id asc --------------------------------------------
    # (S x S comparisons in S_TILE-wide column tiles, tokens as int32: bounded registers)
    si = tl.arange(0, S_BLOCK)
    smask = si < S
    ctok = tl.load(cand_tok_ptr + row * S + si, mask=smask, other=0)
    ctok32 = ctok.to(tl.int32)
    cq = tl.load(cand_q_ptr + row * S + si, mask=smask, other=-1.0)
    rank = tl.zeros([S_BLOCK], tl.int32)
    for js in range(0, S_BLOCK, S_TILE):
        sj = js + tl.arange(0, S_TILE)
        jmask = sj < S
        tj = tl.load(cand_tok_ptr + row * S + sj, mask=jmask, other=0).to(tl.int32)
        qj = tl.load(cand_q_ptr + row * S + sj, mask=jmask, other=-1.0)
        better = ((qj[None, :] > cq[:, None]) | ((qj[None, :] == cq[:, None]) & (tj[None, :] < ctok32[:, None]))) \
            & jmask[None, :]
        rank += tl.sum(better.to(tl.int32), axis=1)
    tl.store(sup_token_ptr + row * S + rank, ctok, mask=smask)
    tl.store(sup_q_ptr + row * S + rank, cq, mask=smask)
    tl.debug_barrier()
    stok = tl.load(sup_token_ptr + row * S + si, mask=smask, other=-1)
    sq = tl.load(sup_q_ptr + row * S + si, mask=smask, other=0.0)
    sq64 = sq.to(tl.float64)
    tail = (si >= M) & smask
    z = tl.sum(tl.where(tail, sq64, 0.0), axis=0)
    tl.store(z_ptr + row, z.to(tl.float32))
    base = tl.load(parent_score_ptr + row).to(tl.float64)
    if M < K:
        n_tail = S - M
        qt = tl.where(z > 0, sq64 / z, 1.0 / n_tail)
        g = tl.load(noise_ptr + row * noise_stride + (si - M), mask=tail, other=0.0).to(tl.float64)
        key = tl.where(tail, tl.log(qt) + g, float("-inf"))
        yr = tl.argmax(key, axis=0)
        y_tok = tl.sum(tl.where(si == yr, stok, 0), axis=0)
        y_q = tl.sum(tl.where(si == yr, sq, 0.0), axis=0)
        y_qt = tl.sum(tl.where(si == yr, qt, 0.0), axis=0)
        tl.store(y_rank_ptr + row, yr.to(tl.int64))
        tl.store(y_token_ptr + row, y_tok)
        tl.store(y_qtilde_ptr + row, y_qt.to(tl.float32))
        if PROXY == 0:
            q_m = tl.sum(tl.where(si == M - 1, sq64, 0.0), axis=0)
            q_1 = tl.sum(tl.where(si == 0, sq, 0.0), axis=0)
            pi = tl.minimum(q_m, z).to(tl.float32) if M > 0 else q_1
        elif PROXY == 1:
            pi = tl.sum(tl.where(si == M, sq, 0.0), axis=0)
        else:
            pi = y_q
        # slot of each support rank: DET ranks 0..M-1 -> their rank; Y -> M;
        # other tail ranks r -> M + 1 + (r - M) - [r > Y] (PAD), kept while < K
        slot = tl.where(si < M, si, M + 1 + (si - M) - (si > yr).to(tl.int32))
        slot = tl.where(si == yr, M, slot)
        w = tl.where(si == yr, pi, sq)
        keep = (slot < K) & smask
    else:
        slot = si
        w = sq
        keep = (si < K) & smask
    score = (base + tl.log(w).to(tl.float64)).to(tl.float32)
    tl.store(child_token_ptr + row * K + slot, stok, mask=keep)
    tl.store(child_q_ptr + row * K + slot, sq, mask=keep)
    tl.store(child_weight_ptr + row * K + slot, w, mask=keep)
    tl.store(child_score_ptr + row * K + slot, score, mask=keep)


#: compile options of every launch here. No mul + add contraction (FMA): in a reduction
#: with one entry per lane (a 16-entry block, the chunks' statistics in
#: ``_row_stats``) the compiler fused the lane's own product into the first butterfly
#: step, fma(own product, partner's rounded product), so lanes i and i ^ 8 got sums
#: rounded differently and equal logits got q 1-2 ulp apart: ties were broken by lane,
#: not by id (an H200, docs/gpu.md; ``scripts/aot_sm90.py`` finds the pattern in the
#: compiled code, ``tests/scripts/test_aot_sm90.py`` runs it). What the unfused multiplies
#: cost on a GPU is not measured yet.
LAUNCH_OPTIONS = dict(enable_fp_fusion=False)


def _written(*shape: int, dtype: torch.dtype, device) -> torch.Tensor:
    """An output or scratch the kernels write in full: no fill. On a GPU each ``zeros`` /
    ``full`` is a launch the host pays for (on the H200 of docs/gpu.md launches, not the
    GPU, set a call's time: 588 us of wall time for 388 us of device time at 10 rows).
    The tests poison these (``test_every_unfilled_output_is_written``)."""
    return torch.empty(shape, dtype=dtype, device=device)


def vocab_chunks(n: int, V: int, support: int, block: int, programs: int) -> int:
    """How many chunks to split each row's vocabulary into so that about ``programs``
    programs run (two per SM on a GPU), at least one block of ``block`` entries each.

    At most ``sqrt(V / support)`` chunks: the merge reads chunks x support candidates per
    row, so this keeps it no longer than a chunk. Rows that fill the GPU alone: 1 (no
    split, one launch). Example: 10 rows, V = 128256, support 128, block 1024, 264
    programs (132 SMs) -> 26 chunks of 5 blocks; 640 rows -> 1.
    """
    blocks = triton.cdiv(V, block)
    c = max(1, min(triton.cdiv(programs, max(n, 1)), blocks, math.isqrt(max(V // max(support, 1), 1))))
    return triton.cdiv(blocks, triton.cdiv(blocks, c))  # whole blocks per chunk, no empty chunk


def default_chunks(n: int, V: int, support: int, device: torch.device | str, block: int = 1024) -> int:
    """The chunk count ``slot_expansion(..., chunks=None)`` uses: ``vocab_chunks`` for two
    programs per SM on CUDA; 1 elsewhere (the interpreter runs programs one after another,
    so a split only adds work there)."""
    device = torch.device(device)
    block = min(block, triton.next_power_of_2(V))
    if device.type != "cuda":
        return 1
    programs = 2 * torch.cuda.get_device_properties(device).multi_processor_count
    return vocab_chunks(n, V, min(support, V), block, programs)


def slot_expansion(logits: torch.Tensor, parent_score: torch.Tensor, noise: torch.Tensor, *,
                   temperature: float, support: int, rheostat: int, slots: int,
                   proxy: str = "default", block: int = 1024, probs: bool = False,
                   chunks: int | None = None) -> SlotExpansion:
    """Same contract as ``reference.slot_expansion``; tensors on the kernel's device.

    ``probs=True``: ``logits`` already holds the draft law ``q [n, V]`` (the Triton
    planner computes it with ``distributions.draft_probs``, the one definition) and the
    kernel skips its softmax; ``temperature`` is then ignored.

    ``chunks``: how many programs share each row's vocabulary (whole blocks of ``block``
    entries each; at most one per block). ``None``: ``vocab_chunks`` for the device (no
    split on the CPU). Integer outputs do not depend on it.
    """
    check_args(logits, parent_score, noise, support, rheostat, slots, proxy)
    n, V = logits.shape
    s, m, K = min(support, V), rheostat, slots
    dev = logits.device
    block = min(block, triton.next_power_of_2(V))
    blocks = triton.cdiv(V, block)
    if chunks is not None and not (isinstance(chunks, int) and 1 <= chunks <= blocks):
        raise ValueError(f"chunks={chunks!r}: allowed an int in [1, {blocks}] (one vocabulary block of "
                         f"{block} entries at least per chunk) or None")
    if chunks is None:
        chunks = default_chunks(n, V, s, dev, block)
    chunk = triton.cdiv(blocks, chunks) * block  # entries per chunk, whole blocks
    chunks = triton.cdiv(V, chunk)
    logits = logits.contiguous()
    if noise.dim() != 2 or noise.shape[0] != n:
        noise = torch.zeros(n, 1, dtype=torch.float64, device=dev)
    noise = noise.to(device=dev, dtype=torch.float64).contiguous()
    ilong = lambda *sh: torch.full(sh, -1, dtype=torch.int64, device=dev)  # noqa: E731
    f32 = lambda *sh: torch.zeros(sh, dtype=torch.float32, device=dev)  # noqa: E731
    wlong = lambda *sh: _written(*sh, dtype=torch.int64, device=dev)  # noqa: E731
    wf32 = lambda *sh: _written(*sh, dtype=torch.float32, device=dev)  # noqa: E731
    # filled: the support (ranks are written by a scatter), Y (not written when m >= K);
    # the kernel writes z, every child slot (slots <= support) and the candidates in full
    out = SlotExpansion(ilong(n, s), f32(n, s), torch.full((n,), s, dtype=torch.int64, device=dev), wf32(n),
                        ilong(n), ilong(n), f32(n), wlong(n, K), wf32(n, K), wf32(n, K), wf32(n, K))
    if n == 0:
        return out
    cand_tok, cand_q = wlong(n, s), wf32(n, s)
    s_block = triton.next_power_of_2(s)
    warps = 4 if s_block <= 128 else 8  # spill-free on sm_90 at S = 128 and 256 (scripts/aot_sm90.py)
    ctok, cq = cand_tok, cand_q  # unsplit: the kernel selects from the vocabulary directly
    if chunks > 1:
        empty = torch.empty(0, dtype=torch.float32, device=dev)
        part_mx, part_s = (wf32(n, chunks), wf32(n, chunks)) if not probs else (empty, empty)
        if not probs:
            softmax_partials_kernel[(n, chunks)](logits, part_mx, part_s, V, chunk, 1.0 / temperature,
                                                 BLOCK=block, num_warps=4, **LAUNCH_OPTIONS)
        ctok, cq = wlong(n, chunks * s), wf32(n, chunks * s)
        chunk_topk_kernel[(n, chunks)](logits, part_mx, part_s, ctok, cq, V, chunk, 1.0 / temperature,
                                       S=s, S_BLOCK=s_block, C_BLOCK=triton.next_power_of_2(chunks), BLOCK=block,
                                       PROBS=probs, num_warps=4, **LAUNCH_OPTIONS)
    slot_expansion_kernel[(n,)](
        logits, ctok, cq, parent_score.to(device=dev, dtype=torch.float32).contiguous(), noise, cand_tok, cand_q,
        out.sup_token, out.sup_q, out.z, out.y_rank, out.y_token, out.y_qtilde,
        out.child_token, out.child_q, out.child_weight, out.child_score,
        V, chunks * s, noise.shape[1], 1.0 / temperature, S=s, S_BLOCK=s_block,
        S_TILE=min(s_block, 32 if s_block <= 128 else 16), M=m, K=K, PROXY=PROXY_CODES[proxy],
        BLOCK=min(block, triton.next_power_of_2(chunks * s)) if chunks > 1 else block, PROBS=probs,
        MERGE=chunks > 1, num_warps=warps, **LAUNCH_OPTIONS)
    return out
