"""Triton planner bookkeeping kernels: one program per tree (same signatures as ``reference``).

* ``topk_kernel``: rank of every candidate node = number of candidates that beat it
  (score desc, id asc, NaN last), by pairwise comparison in tiles; rank < k selects it,
  and the rank is its output slot. Frontier (depth == level: the level's id range only,
  ids being depth-major) and pruning (ids >= 1) are the same kernel.
* ``linearize_kernel``: linear index = prefix count of kept ids; parents through a
  scratch id -> linear map; ancestor words level by level (a node's words are its
  parent's plus its own bit); first_child / n_children from sibling contiguity; one
  root-to-leaf path per leaf, walked upwards ``D`` steps for all leaves at once.

All outputs are integers or bools and must equal the reference exactly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rheoplan.kernels.plan.reference import Linear


@triton.jit
def _beats(sa, ia, sb, ib):
    """a ranks before b: higher score, then lower id; NaN after everything."""
    na = sa != sa
    nb = sb != sb
    plain = (sa > sb) | ((sa == sb) & (ia < ib))
    return tl.where(na | nb, (nb & ~na) | (na & nb & (ia < ib)), plain)


@triton.jit
def topk_kernel(score_ptr, depth_ptr, n_nodes_ptr, out_ptr, count_ptr, M, level, k,
                WRITE_IDS: tl.constexpr, BLOCK: tl.constexpr):
    """WRITE_IDS: out[b, rank] = id (frontier); else out[b, id] = rank < k (kept mask)."""
    b = tl.program_id(0).to(tl.int64)
    # both loops stop at the tree's node count, not the capacity M
    n = tl.minimum(tl.load(n_nodes_ptr + b), M)
    total = 0
    if WRITE_IDS:
        # ids are depth-major (an IR invariant, planner/lint.py), so the nodes at `level` are
        # the ids [lo, hi): one counting pass, then the pairwise ranking over that level only
        # (O(width^2), not O(n^2) over the whole tree)
        lo = tl.full((), 0, tl.int32)
        hi = tl.full((), 0, tl.int32)
        for s in range(0, n, BLOCK):
            v = s + tl.arange(0, BLOCK)
            d = tl.load(depth_ptr + b * M + v, mask=v < n, other=level + 1)
            lo += tl.sum(((v < n) & (d < level)).to(tl.int32), axis=0)
            hi += tl.sum(((v < n) & (d <= level)).to(tl.int32), axis=0)
    else:
        tl.store(out_ptr + b * M, True)  # the root is always kept (also when n = 0)
        lo = tl.full((), 1, tl.int32)  # pruning ranks every drafted node
        hi = n.to(tl.int32)
    for si in range(lo, hi, BLOCK):
        i = si + tl.arange(0, BLOCK)
        s_i = tl.load(score_ptr + b * M + i, mask=i < hi, other=0.0)
        d_i = tl.load(depth_ptr + b * M + i, mask=i < hi, other=-1)
        # the depth test stays: were ids not depth-major, a node would be missed, never a wrong one taken
        cand_i = (i < hi) & ((d_i == level) | (tl.full([BLOCK], level, tl.int32) < 0))
        rank = tl.zeros([BLOCK], dtype=tl.int32)
        for sj in range(lo, hi, BLOCK):
            j = sj + tl.arange(0, BLOCK)
            s_j = tl.load(score_ptr + b * M + j, mask=j < hi, other=0.0)
            d_j = tl.load(depth_ptr + b * M + j, mask=j < hi, other=-1)
            cand_j = (j < hi) & ((d_j == level) | (tl.full([BLOCK], level, tl.int32) < 0))
            beat = _beats(s_j[None, :], j[None, :], s_i[:, None], i[:, None]) & cand_j[None, :]
            rank += tl.sum(beat.to(tl.int32), axis=1)
        sel = (cand_i & (rank < k)) != 0
        if WRITE_IDS:
            tl.store(out_ptr + b * k + rank, i.to(tl.int64), mask=sel)
        else:
            tl.store(out_ptr + b * M + i, sel, mask=i < hi)
        total += tl.sum(sel.to(tl.int32), axis=0)
    tl.store(count_ptr + b, total.to(tl.int64))


def _topk(score, depth, n_nodes, level, k, write_ids):
    B, M = score.shape
    dev = score.device
    count = torch.zeros(B, dtype=torch.int64, device=dev)
    if write_ids:
        out = torch.full((B, k), -1, dtype=torch.int64, device=dev)
    else:
        out = torch.zeros(B, M, dtype=torch.bool, device=dev)
    topk_kernel[(B,)](score.contiguous(), depth.to(dev).contiguous(), n_nodes.to(dev).contiguous(), out, count,
                      M, level, k,
                      WRITE_IDS=write_ids, BLOCK=max(16, min(64, triton.next_power_of_2(M))))
    return out, count


def frontier_topk(score, depth, n_nodes, level, k):
    """Same contract as ``reference.frontier_topk``."""
    return _topk(score, depth, n_nodes, int(level), int(k), True)


def prune_topn(score, n_nodes, budget):
    """Same contract as ``reference.prune_topn``."""
    return _topk(score, score, n_nodes, -1, int(budget), False)[0]  # depth unused (level < 0)


@triton.jit
def linearize_kernel(kept_ptr, n_nodes_ptr, parent_ptr, token_ptr, depth_ptr, exp_row_ptr, prefix_ptr,
                     lin_of_ptr, n_ptr, node_ptr, tok_ptr, pos_ptr, par_ptr, dep_ptr, erow_ptr, first_ptr,
                     nch_ptr, mask_ptr, bits_ptr, paths_ptr, n_paths_ptr, M, L,
                     W: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_L: tl.constexpr,
                     COL_TILE: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    n_nodes = tl.load(n_nodes_ptr + b)
    prefix = tl.load(prefix_ptr + b)
    # 1. linear index of every kept id (prefix count), written to the id -> linear map
    carry = 0
    for s in range(0, M, BLOCK_M):
        v = s + tl.arange(0, BLOCK_M)
        kept = tl.load(kept_ptr + b * M + v, mask=v < n_nodes, other=0).to(tl.int1)
        li = carry + tl.cumsum(kept.to(tl.int32), axis=0) - 1
        tl.store(lin_of_ptr + b * M + v, tl.where(kept, li, -1).to(tl.int64), mask=v < M)
        tl.store(node_ptr + b * L + li, v.to(tl.int64), mask=kept & (li < L))  # more kept than L: no overrun
        carry += tl.sum(kept.to(tl.int32), axis=0)
    tl.store(n_ptr + b, carry.to(tl.int64))
    k = tl.minimum(carry, L)  # indexing bound only: n keeps the true count
    tl.debug_barrier()
    # 2. per linear node: tables gathered through its id
    i = tl.arange(0, BLOCK_L)
    real = i < k
    v = tl.load(node_ptr + b * L + i, mask=real, other=0)
    dep = tl.load(depth_ptr + b * M + v, mask=real, other=-1)
    pv = tl.load(parent_ptr + b * M + v, mask=real, other=-1)
    par = tl.load(lin_of_ptr + b * M + pv, mask=real & (pv >= 0), other=-1)
    tl.store(tok_ptr + b * L + i, tl.load(token_ptr + b * M + v, mask=real, other=-1), mask=real)
    tl.store(dep_ptr + b * L + i, dep, mask=real)
    tl.store(pos_ptr + b * L + i, prefix + dep, mask=real)
    tl.store(erow_ptr + b * L + i, tl.load(exp_row_ptr + b * M + v, mask=real, other=-1), mask=real)
    tl.store(par_ptr + b * L + i, par, mask=real)
    # children of a node are contiguous: i is a first child iff i-1 has another parent
    prev_par = tl.load(par_ptr + b * L + i - 1, mask=real & (i >= 1), other=-2)
    tl.debug_barrier()
    prev_par = tl.load(par_ptr + b * L + i - 1, mask=real & (i >= 1), other=-2)
    is_first = real & (par >= 0) & (prev_par != par)
    tl.store(first_ptr + b * L + par, i.to(tl.int64), mask=is_first)
    tl.atomic_add(nch_ptr + b * L + par, tl.full([BLOCK_L], 1, tl.int64), mask=real & (par >= 0))
    # 3. ancestor words, one depth level at a time (parents are one level up)
    one = tl.full([BLOCK_L], 1, tl.int64)
    for d in range(0, D + 1):
        for w in range(0, W):
            at = real & (dep == d)
            own = tl.where((i // 64) == w, one << (i % 64).to(tl.int64), 0)
            up = tl.load(bits_ptr + (b * L + par) * W + w, mask=at & (par >= 0), other=0)
            tl.store(bits_ptr + (b * L + i) * W + w, up | own, mask=at)
        tl.debug_barrier()
    # dense mask in COL_TILE-wide column tiles: a [BLOCK_L, BLOCK_L] int64 tile spills
    # kilobytes per thread (and compiles for minutes) from BLOCK_L = 256 up
    for js in range(0, BLOCK_L, COL_TILE):
        j = js + tl.arange(0, COL_TILE)
        words = tl.load(bits_ptr + (b * L + i[:, None]) * W + (j[None, :] // 64),
                        mask=real[:, None] & (j[None, :] < L), other=0)
        m2 = ((words >> (j[None, :] % 64).to(tl.int64)) & 1) != 0
        tl.store(mask_ptr + (b * L + i[:, None]) * L + j[None, :], m2, mask=(i[:, None] < L) & (j[None, :] < L))
    # 4. one path per leaf (no kept child), walked upwards
    tl.debug_barrier()
    nch = tl.load(nch_ptr + b * L + i, mask=real, other=1)
    leaf = real & (nch == 0)
    prow = tl.cumsum(leaf.to(tl.int32), axis=0) - 1
    cur = i
    for _ in range(0, D + 1):
        ok = leaf & (cur >= 0)
        cd = tl.load(dep_ptr + b * L + cur, mask=ok, other=0)
        tl.store(paths_ptr + (b * L + prow) * (D + 1) + cd, cur.to(tl.int64), mask=ok)
        cur = tl.load(par_ptr + b * L + cur, mask=ok, other=-1).to(tl.int32)
    tl.store(n_paths_ptr + b, tl.sum(leaf.to(tl.int32), axis=0).to(tl.int64))


def linearize(kept, n_nodes, parent, token, depth, exp_row, prefix_len, budget, max_depth,
              trim_paths: bool = True) -> Linear:
    """Same contract as ``reference.linearize`` (L = 1 + budget must fit one block).

    ``trim_paths=False`` returns ``paths`` at full width ``[B, L, D + 1]`` (rows past
    ``n_paths`` are -1) instead of cutting it to ``max(n_paths)`` rows: cutting needs the
    value on the host, a device-to-host sync per call that also blocks CUDA-graph capture.
    """
    B, M = kept.shape
    L, D = 1 + budget, max_depth
    W = (L + 63) // 64
    dev = kept.device
    full = lambda *s, v=-1: torch.full(s, v, dtype=torch.int64, device=dev)  # noqa: E731
    node, tok, pos, par, dep, erow, first = (full(B, L) for _ in range(7))
    n, n_paths = full(B, v=0), full(B, v=0)
    nch = full(B, L, v=0)
    mask = torch.zeros(B, L, L, dtype=torch.bool, device=dev)
    bits = full(B, L, W, v=0)
    paths = full(B, L, D + 1)
    lin_of = full(B, M)
    # [BLOCK_L, COL_TILE] int64 mask tiles of <= 4096 words: spill-free on sm_90 up to budget 511
    # (scripts/aot_sm90.py); BLOCK_M up to 1024 for the id scan
    block_l = triton.next_power_of_2(L)
    col_tile = max(1, min(64, 4096 // block_l))
    col_tile = min(col_tile, block_l)
    on = lambda t: t.to(dev).contiguous()  # noqa: E731  (a CPU table among device ones: moved, not an error)
    linearize_kernel[(B,)](on(kept), on(n_nodes), on(parent), on(token), on(depth), on(exp_row), on(prefix_len), lin_of, n, node, tok, pos, par, dep, erow,
                           first, nch, mask, bits, paths, n_paths, M, L, W=W, D=D,
                           BLOCK_M=min(1024, block_l * 4), BLOCK_L=block_l, COL_TILE=col_tile,
                           num_warps=8 if block_l >= 256 else 4)
    if trim_paths:
        paths = paths[:, :int(n_paths.max())].contiguous()
    return Linear(n, node, tok, pos, par, dep, mask, bits, paths, n_paths, first, nch, erow)
