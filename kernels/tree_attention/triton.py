"""Triton tree attention (same contract as ``reference.tree_attention``).

Grid: (B * Hkv, ceil(GROUP * L / BLOCK_M)). The GROUP query heads that share a kv head are
packed into the rows of one program (row ``r`` = head ``hk * GROUP + r // L``, query
``r % L``), so a kv tile is loaded once for all of them. Each program streams the cached
prefix in BLOCK_N tiles up to ``prefix_len[b]`` (not the capacity), then the tree block
(visible: bit ``c % 64`` of word ``c // 64`` of the query's ancestor row), with an online
softmax accumulated in float32.

Precision: Q, K, V stay in their storage dtype for ``tl.dot`` (16-bit inputs run on the
16-bit tensor cores) and P is cast to V's dtype before the second dot; both dots
accumulate in float32. For float32 inputs ``input_precision`` is "ieee" unless the caller
allows TF32 (compiled fp32 dots default to TF32, the interpreter computes exact fp32).

Any head dim up to 256: ``D`` is padded to the next power of two (at least 16) inside the
kernel and the padded lanes are masked on every load and store (80 -> 128, 96 -> 128,
8 -> 16); zero lanes add nothing to ``q . k``. Every tensor is addressed through its
strides (a ``view(B, L, H, d).transpose(1, 2)`` query needs no copy); the batch and head
base offsets are int64, offsets inside one batch row int32 (checked by the wrapper).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl


@triton.jit
def _online_softmax_step(qv, k, v, visible, m_i, l_i, acc, SCALE, PREC: tl.constexpr):
    """Fold one key/value tile into the running (max, sum, output) of an online softmax.
    Rows with nothing visible yet keep max -inf; ``m_safe`` avoids inf - inf there."""
    s = tl.dot(qv, tl.trans(k), input_precision=PREC) * SCALE
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    pr = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(pr, axis=1)
    acc = acc * alpha[:, None] + tl.dot(pr.to(v.dtype), v, input_precision=PREC)
    return m_new, l_i, acc


@triton.jit
def tree_attention_kernel(q_ptr, kc_ptr, vc_ptr, kt_ptr, vt_ptr, prefix_ptr, bits_ptr, out_ptr,
                          sq_b, sq_h, sq_l, sq_d, skc_b, skc_h, skc_l, skc_d, svc_b, svc_h, svc_l, svc_d,
                          skt_b, skt_h, skt_l, skt_d, svt_b, svt_h, svt_l, svt_d, so_b, so_h, so_l, so_d,
                          Hkv, L, P, W, SCALE, split_len, part_m_ptr, part_l_ptr, part_acc_ptr, B, Hq,
                          GROUP: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, PREC: tl.constexpr, SPLIT: tl.constexpr):
    """SPLIT: program axis 2 splits the prefix into ``split_len``-column chunks (the last split
    also takes the tree block) and each program writes its unnormalised (max, sum, acc) to
    the ``part_*`` scratch; ``combine_splits`` merges them. Without SPLIT one program
    covers the whole prefix and writes the output."""
    # int64 only in the per-(batch, head) base pointers; offsets inside one head's slice are
    # int32 (the wrapper checks that a slice spans < 2**31 elements): int64 [BLOCK, D] offset
    # tiles double the registers of the address arithmetic and made the kernel spill
    bh = tl.program_id(0)
    b = (bh // Hkv).to(tl.int64)
    hk = bh % Hkv
    r = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    h = hk * GROUP + r // L  # query head of each packed row
    qi = r % L  # query (linear tree node) of each packed row
    rmask = r < GROUP * L
    dd = tl.arange(0, D_PAD)
    dmask = dd < D
    qv = tl.load(q_ptr + b * sq_b + (h[:, None] * sq_h + qi[:, None] * sq_l + dd[None, :] * sq_d),
                 mask=rmask[:, None] & dmask[None, :], other=0.0)
    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    kc_base = kc_ptr + b * skc_b + hk.to(tl.int64) * skc_h
    vc_base = vc_ptr + b * svc_b + hk.to(tl.int64) * svc_h
    kt_base = kt_ptr + b * skt_b + hk.to(tl.int64) * skt_h
    vt_base = vt_ptr + b * svt_b + hk.to(tl.int64) * svt_h
    bits_base = bits_ptr + b * L * W
    # the kernel never reads past the capacity P, whatever prefix_len says
    plen = tl.minimum(tl.load(prefix_ptr + b), P).to(tl.int32)
    lo = 0
    hi = plen
    tree_end = L
    if SPLIT:
        sp = tl.program_id(2)
        lo = sp * split_len
        hi = tl.minimum(lo + split_len, plen)
        tree_end = tl.where(sp == tl.num_programs(2) - 1, L, 0)
    for start in range(lo, hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        cin = cols < hi
        visible = rmask[:, None] & cin[None, :]
        kv_mask = cin[:, None] & dmask[None, :]
        k = tl.load(kc_base + (cols[:, None] * skc_l + dd[None, :] * skc_d), mask=kv_mask, other=0.0)
        v = tl.load(vc_base + (cols[:, None] * svc_l + dd[None, :] * svc_d), mask=kv_mask, other=0.0)
        m_i, l_i, acc = _online_softmax_step(qv, k, v, visible, m_i, l_i, acc, SCALE, PREC)
    for start in range(0, tree_end, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        cin = cols < L
        # BLOCK_N <= 64 and start % BLOCK_N == 0: the whole tile lies in word start // 64, so one
        # word per row (a [BLOCK_M] vector, not a [BLOCK_M, BLOCK_N] int64 tile that spilled)
        word = tl.load(bits_base + (qi * W + start // 64), mask=rmask, other=0)
        visible = ((word[:, None] >> (cols[None, :] % 64).to(tl.int64)) & 1) != 0
        visible = visible & cin[None, :]
        kv_mask = cin[:, None] & dmask[None, :]
        k = tl.load(kt_base + (cols[:, None] * skt_l + dd[None, :] * skt_d), mask=kv_mask, other=0.0)
        v = tl.load(vt_base + (cols[:, None] * svt_l + dd[None, :] * svt_d), mask=kv_mask, other=0.0)
        m_i, l_i, acc = _online_softmax_step(qv, k, v, visible, m_i, l_i, acc, SCALE, PREC)
    if SPLIT:
        # partials of row (b, h, qi) of split sp at [sp, b, h, qi] (acc: [..., D_PAD])
        first = (tl.program_id(2).to(tl.int64) * B + b) * Hq * L  # int64 base, int32 in-row offsets
        row = h * L + qi
        tl.store(part_m_ptr + first + row, m_i, mask=rmask)
        tl.store(part_l_ptr + first + row, l_i, mask=rmask)
        tl.store(part_acc_ptr + first * D_PAD + (row[:, None] * D_PAD + dd[None, :]), acc, mask=rmask[:, None])
    else:
        # a row that sees nothing (no prefix, padded tree row) writes 0, not 0/0 = NaN: a NaN
        # row would poison every row of the next layer's tiles through 0 * NaN in dot(p, v)
        out = tl.where(l_i[:, None] > 0, acc / tl.where(l_i > 0, l_i, 1.0)[:, None], 0.0)
        tl.store(out_ptr + b * so_b + (h[:, None] * so_h + qi[:, None] * so_l + dd[None, :] * so_d),
                 out.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & dmask[None, :])


def _pow2_at_least_16(name: str, value: int) -> None:
    if value < 16 or value & (value - 1):
        raise ValueError(f"{name}={value}: allowed a power of two >= 16 (tl.dot's smallest tile)")


def launch_config(dtype: torch.dtype, d_pad: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) sized for sm_90 (232,448 B shared memory, 255 registers).

    Chosen from ahead-of-time sm_90 compiles (Triton 3.9, ``scripts/aot_sm90.py``, GROUP 4,
    3 stages): each row of the table compiles with 0 bytes of spill stack, with and without
    the split prefix. Examples: bf16 d=128 64/32/8 warps -> 254-255 registers, 33.8 KB
    shared; bf16 d=128 at 64/64 spilled (24-232 B per thread at 8/4 warps); fp32 d=128
    32/32/8 -> 200-212 registers, 86.5 KB (4 warps spilled 24 B with the split prefix);
    fp32 d=256 16/16/8 -> 105-172 registers, 83.3 KB.

    Example: ``launch_config(torch.bfloat16, 128) == (64, 32, 8)``.
    """
    if dtype == torch.float32:
        return (32, 32, 8) if d_pad <= 128 else (16, 16, 8)
    if d_pad <= 64:
        return 64, 64, 8
    return (64, 32, 8) if d_pad <= 128 else (32, 32, 8)


@triton.jit
def combine_splits_kernel(part_m_ptr, part_l_ptr, part_acc_ptr, out_ptr, NS, R, Hq, L, so_b, so_h, so_l, so_d,
                          D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_R: tl.constexpr):
    """``combine_splits_reference`` in one launch: program ``i`` merges rows ``i * BLOCK_R``..
    of the ``R = B * Hq * L`` query rows (row ``r``: batch ``r // (Hq L)``, head
    ``r // L % Hq``, query ``r % L``) over the ``NS`` splits, two passes over them (the
    largest max, then the weighted sums)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < R
    dd = tl.arange(0, D_PAD)
    top = tl.full([BLOCK_R], float("-inf"), tl.float32)
    for sp in range(0, NS):
        top = tl.maximum(top, tl.load(part_m_ptr + sp * R + rows, mask=rmask, other=float("-inf")))
    top = tl.where(top == float("-inf"), 0.0, top)
    total = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, D_PAD], tl.float32)
    for sp in range(0, NS):
        w = tl.exp(tl.load(part_m_ptr + sp * R + rows, mask=rmask, other=float("-inf")) - top)  # -inf: 0
        total += tl.load(part_l_ptr + sp * R + rows, mask=rmask, other=0.0) * w
        a = tl.load(part_acc_ptr + (sp * R + rows.to(tl.int64))[:, None] * D_PAD + dd[None, :],
                    mask=rmask[:, None], other=0.0)
        acc += a * w[:, None]
    res = tl.where(total[:, None] > 0, acc / tl.where(total > 0, total, 1.0)[:, None], 0.0)
    b = rows // (Hq * L)
    h = (rows // L) % Hq
    qi = rows % L
    off = b.to(tl.int64) * so_b + h * so_h + qi * so_l
    tl.store(out_ptr + off[:, None] + dd[None, :] * so_d, res.to(out_ptr.dtype.element_ty),
             mask=rmask[:, None] & (dd[None, :] < D))


def combine_splits(part_m, part_l, part_acc, out, d: int) -> None:
    """Merge per-split online-softmax partials ``[S, B, Hq, L]`` (max, sum) and ``[..., D_PAD]``
    (unnormalised output, contiguous) into ``out [B, Hq, L, d]`` (any strides) in one launch;
    rows that see nothing get 0. Same result as ``combine_splits_reference``, whose dozen
    torch ops are a launch each: on the H200 of docs/gpu.md a tree-attention call with
    them took 706 us of wall time for 47 us of device time."""
    NS, B, Hq, L = part_m.shape
    R = B * Hq * L
    d_pad = part_acc.shape[-1]
    block_r = max(1, min(64, 4096 // d_pad))  # acc tile [BLOCK_R, D_PAD] <= 4096 floats
    combine_splits_kernel[(triton.cdiv(R, block_r),)](
        part_m, part_l, part_acc, out, NS, R, Hq, L, *out.stride(), D=d, D_PAD=d_pad, BLOCK_R=block_r, num_warps=4)


def combine_splits_reference(part_m, part_l, part_acc, out, d: int) -> None:
    """The merge ``combine_splits`` launches, in torch (its test's reference).

    Example: two splits with maxima (0, 1), sums (1, 1), outputs (2, 4) give
    ``(2 e^-1 + 4) / (e^-1 + 1)``.
    """
    top = part_m.amax(0)
    top = torch.where(top == float("-inf"), torch.zeros_like(top), top)
    w = torch.exp(part_m - top)  # a split that saw nothing has max -inf: weight 0
    total = (part_l * w).sum(0)
    acc = (part_acc * w[..., None]).sum(0)
    res = torch.where(total[..., None] > 0, acc / torch.where(total > 0, total, 1.0)[..., None], 0.0)
    out.copy_(res[..., :d])


def default_splits(device: torch.device, programs: int, prefix_capacity: int, block_n: int) -> int:
    """How many programs share one prefix (flash-decoding): enough for ~2 programs per SM, each
    split at least 256 columns, 1 off CUDA. At batch 1 a model has only ``Hkv`` (3-8) kv heads,
    so without splitting 3-32 programs would stream the whole prefix on a 132-SM H200.

    Example: 9 programs, P = 4096 on 132 SMs -> min(ceil(264 / 9), 4096 // 256) = 16.
    """
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(-(-2 * sms // programs), prefix_capacity // max(256, block_n)))


def tree_attention(q, k_cache, v_cache, k_tree, v_tree, prefix_len, ancestor_bits, scale=None,
                   block_m: int | None = None, block_n: int | None = None, num_warps: int | None = None,
                   allow_tf32: bool = False, num_splits: int | None = None):
    """Same contract as ``reference.tree_attention`` (rows that see nothing come out 0).

    Any strides; any head dim ``d <= 256``; ``prefix_len`` and ``ancestor_bits`` may sit on
    the CPU (they are moved to ``q``'s device); q/k/v must already be on one device.
    ``prefix_len[b]`` must be ``<= P``: the kernel reads at most ``P`` cached entries and does
    not check further (checking would cost a device-to-host sync per call).

    Returns ``out [B, Hq, L, d]`` as a view of a ``[B, L, Hq, d]`` contiguous buffer, so
    ``out.transpose(1, 2)`` is the ``[B, L, Hq, d]`` layout a transformers attention returns,
    with no copy. ``allow_tf32`` lets float32 inputs use TF32 dots (faster, ~1e-3 relative).
    ``num_splits`` programs share each prefix (``default_splits`` when None: 1 off CUDA); their
    partial softmax states are merged by ``combine_splits`` (one more launch).
    """
    if q.dim() != 4 or k_cache.dim() != 4:
        raise ValueError(f"q and k_cache must be 4-D [B, H, len, d], got {tuple(q.shape)}, {tuple(k_cache.shape)}")
    B, Hq, L, d = q.shape
    Hkv, P = k_cache.shape[1], k_cache.shape[2]
    for name, t, shape in (("k_cache", k_cache, (B, Hkv, P, d)), ("v_cache", v_cache, (B, Hkv, P, d)),
                           ("k_tree", k_tree, (B, Hkv, L, d)), ("v_tree", v_tree, (B, Hkv, L, d))):
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} must be {shape}, got {tuple(t.shape)}")
        if t.dtype != q.dtype or t.device != q.device:
            raise ValueError(f"{name} is {t.dtype} on {t.device}; q is {q.dtype} on {q.device}: "
                             "q, k and v must share dtype and device")
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"q.dtype={q.dtype}: allowed float32, float16, bfloat16")
    if Hq % Hkv:
        raise ValueError(f"Hq={Hq} must be a multiple of Hkv={Hkv}")
    if not 1 <= d <= 256:
        raise ValueError(f"head dim d={d}: allowed 1..256 (padded to a power of two inside)")
    W = (L + 63) // 64
    if tuple(prefix_len.shape) != (B,):
        raise ValueError(f"prefix_len must be [{B}], got {tuple(prefix_len.shape)}")
    if tuple(ancestor_bits.shape) != (B, L, W):
        raise ValueError(f"ancestor_bits must be [{B}, {L}, {W}] (64 nodes per int64 word), "
                         f"got {tuple(ancestor_bits.shape)}")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k_tree", k_tree),
                    ("v_tree", v_tree)):
        span = sum(abs(st) * (n - 1) for st, n in zip(t.stride()[1:], t.shape[1:]))
        if span >= 2 ** 31:
            raise ValueError(f"{name}: one batch row spans {span} elements; the kernel's in-row offsets "
                             "are int32 (allowed < 2**31)")
    d_pad = max(16, triton.next_power_of_2(d))
    bm, bn, nw = launch_config(q.dtype, d_pad)
    block_m, block_n, num_warps = block_m or bm, block_n or bn, num_warps or nw
    _pow2_at_least_16("block_m", block_m)
    _pow2_at_least_16("block_n", block_n)
    if block_n > 64:
        raise ValueError(f"block_n={block_n}: allowed <= 64 (one ancestor word covers a column tile)")
    group = Hq // Hkv
    buf = torch.empty(B, L, Hq, d, dtype=q.dtype, device=q.device)
    out = buf.transpose(1, 2)
    if B == 0 or L == 0 or Hq == 0:
        return out
    prefix_len = prefix_len.to(device=q.device, dtype=torch.int64)
    ancestor_bits = ancestor_bits.to(device=q.device, dtype=torch.int64).contiguous()
    prec = "ieee" if q.dtype == torch.float32 and not allow_tf32 else "tf32"
    base = (B * Hkv, triton.cdiv(group * L, block_m))
    if num_splits is None:
        num_splits = default_splits(q.device, base[0] * base[1], P, block_n)
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"num_splits={num_splits!r}: allowed an int >= 1")
    # columns per split: a multiple of BLOCK_N, so every tile lies inside one split
    split_len = triton.cdiv(triton.cdiv(max(P, 1), num_splits), block_n) * block_n
    num_splits = max(1, triton.cdiv(P, split_len))
    split = num_splits > 1
    f32 = dict(dtype=torch.float32, device=q.device)
    parts = ((torch.empty(num_splits, B, Hq, L, **f32), torch.empty(num_splits, B, Hq, L, **f32),
              torch.empty(num_splits, B, Hq, L, d_pad, **f32)) if split else (out, out, out))
    tree_attention_kernel[base + (num_splits,)](
        q, k_cache, v_cache, k_tree, v_tree, prefix_len, ancestor_bits, out,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *k_tree.stride(), *v_tree.stride(), *out.stride(),
        Hkv, L, P, W, float(scale) if scale is not None else 1.0 / math.sqrt(d), split_len, *parts, B, Hq,
        GROUP=group, D=d, D_PAD=d_pad, BLOCK_M=block_m, BLOCK_N=block_n, PREC=prec, SPLIT=split,
        num_warps=num_warps)
    if split:
        combine_splits(*parts, out, d)
    return out
