"""numba CPU path of the planner bookkeeping kernels (same signatures as ``reference``).

The ``*_rows`` kernels work on numpy views of the IR's tensors and write into
preallocated outputs; the CPU pipeline calls them directly. Selection is by insertion
into a sorted buffer of size k (k, N <= a few hundred: cheaper than sorting all nodes).
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit

from rheoplan.kernels.plan.reference import Linear


@njit(cache=True, inline="always")
def _better(sa, ia, sb, ib):
    """Node a ranks before b: higher score, then lower id; NaN ranks after everything."""
    na, nb = np.isnan(sa), np.isnan(sb)
    if na or nb:
        return (nb and not na) or (na and nb and ia < ib)
    return sa > sb or (sa == sb and ia < ib)


@njit(cache=True)
def _select(score_row, lo, hi, level, depth_row, k, out):
    """Best ``k`` ids in ``[lo, hi)`` (only depth == level when level >= 0) into ``out``,
    best first; returns how many."""
    cnt = 0
    for i in range(lo, hi):
        if level >= 0 and depth_row[i] != level:
            continue
        s = score_row[i]
        if cnt == k and not _better(s, i, score_row[out[k - 1]], out[k - 1]):
            continue
        j = cnt if cnt < k else k - 1
        while j > 0 and _better(s, i, score_row[out[j - 1]], out[j - 1]):
            out[j] = out[j - 1]
            j -= 1
        out[j] = i
        if cnt < k:
            cnt += 1
    return cnt


@njit(cache=True)
def frontier_rows(score, depth, n_nodes, level, k, nodes, count):
    """``nodes[b, :count[b]]`` = the ``k`` best ids at depth ``level`` (rest -1)."""
    for b in range(score.shape[0]):
        nodes[b, :] = -1
        count[b] = _select(score[b], 0, n_nodes[b], level, depth[b], k, nodes[b])


@njit(cache=True)
def prune_rows(score, n_nodes, budget, kept):
    buf = np.empty(max(budget, 1), dtype=np.int64)
    for b in range(score.shape[0]):
        kept[b, :] = False
        kept[b, 0] = True
        c = _select(score[b], 1, n_nodes[b], -1, score[b], budget, buf)  # depth unused
        for j in range(c):
            kept[b, buf[j]] = True


@njit(cache=True)
def linearize_rows(kept, n_nodes, parent, token, depth, exp_row, prefix_len,
                   n, node, tok, pos, par, dep, erow, first, n_children, mask, bits, paths, n_paths):
    """Fill the linear tables (outputs preset to -1 / 0 / False by the caller)."""
    M = kept.shape[1]
    lin_of = np.empty(M, dtype=np.int64)
    for b in range(kept.shape[0]):
        k = 0
        for v in range(n_nodes[b]):
            lin_of[v] = -1
            if not kept[b, v]:
                continue
            lin_of[v] = k
            node[b, k] = v
            tok[b, k] = token[b, v]
            dep[b, k] = depth[b, v]
            pos[b, k] = prefix_len[b] + depth[b, v]
            erow[b, k] = exp_row[b, v]
            pv = parent[b, v]
            if pv >= 0:
                pi = lin_of[pv]
                par[b, k] = pi
                mask[b, k, :k] = mask[b, pi, :k]
                for w in range(bits.shape[2]):
                    bits[b, k, w] = bits[b, pi, w]
                if first[b, pi] < 0:
                    first[b, pi] = k
                n_children[b, pi] += 1
            mask[b, k, k] = True
            bits[b, k, k // 64] |= np.int64(1) << np.int64(k % 64)
            k += 1
        n[b] = k
        p = 0
        for leaf in range(k):
            if n_children[b, leaf] != 0:
                continue
            i = leaf
            while i >= 0:  # depth of linear node i is its column in the path
                paths[b, p, dep[b, i]] = i
                i = par[b, i]
            p += 1
        n_paths[b] = p


@njit(cache=True)
def draft_depth_widths(n_expanded, exp_node, depth, widest):
    """``widest[d]``: the most nodes any tree expanded at depth ``d`` (one batched draft
    call per depth, every row padded to it; ``costmodel.draft_ms_batch``)."""
    widest[:] = 0
    count = np.zeros(widest.shape[0], dtype=np.int64)
    for b in range(n_expanded.shape[0]):
        count[:] = 0
        for r in range(n_expanded[b]):
            count[depth[b, exp_node[b, r]]] += 1
        for d in range(widest.shape[0]):
            widest[d] = max(widest[d], count[d])


@njit(cache=True)
def cost_decide_rows(kind, weight, parent, token, score, n_nodes, table, sampled, scale, budget, verify_ms,
                     draft_ms, overhead_ms, acc, order, count, chosen):
    """``planner.cost_prune.decide`` for ``B`` trees in one call.

    * ``acc [B, capacity]`` (float64, zeroed by the caller): ``costmodel.node_acceptance``
      of every tree, ``table[class][bucket]`` times the parent's in creation order, then
      times ``scale`` capped at 1 when ``scale != 1``;
    * ``order [B, max(budget, 1)]``, ``count [B]``: each tree's ``budget`` best drafted
      nodes (token >= 0) by the global ranking (``_better``: ``rheoplan.ir.rank_key_order``);
    * the trees' candidates merged by acceptance (ties to the lower row), and
      ``costmodel.choose_n`` over the merge with ``base = B`` tokens: the forward of the
      first ``N`` merged candidates is ``verify_ms[k]``, ``k`` the widest row's tokens
      (``Timings.verify_batch`` at this ``B`` and context); ``chosen [B]`` each row's share.

    Returns ``(E, cost)``. The float operations are the reference's, in its order, so the
    decision is the same to the bit."""
    B = n_nodes.shape[0]
    nb = table.shape[1]
    total = 0
    for b in range(B):
        acc[b, 0] = 1.0
        for v in range(1, n_nodes[b]):
            if token[b, v] < 0:
                continue
            w = np.float64(weight[b, v])
            bk = 0
            if w > 0:  # costmodel.weight_bucket
                bk = min(nb - 1, int(w * nb))
            cls = 1 if kind[b, v] == sampled else 0
            acc[b, v] = table[cls, bk] * acc[b, parent[b, v]]
        if scale != 1.0:
            for v in range(1, acc.shape[1]):
                acc[b, v] = min(1.0, acc[b, v] * scale)
        cnt = 0
        if budget > 0:
            for i in range(1, n_nodes[b]):
                if token[b, i] < 0:
                    continue
                s = score[b, i]
                last = order[b, budget - 1]
                if cnt == budget and not _better(s, i, score[b, last], last):
                    continue
                j = cnt if cnt < budget else budget - 1
                while j > 0 and _better(s, i, score[b, order[b, j - 1]], order[b, j - 1]):
                    order[b, j] = order[b, j - 1]
                    j -= 1
                order[b, j] = i
                if cnt < budget:
                    cnt += 1
        count[b] = cnt
        total += cnt
    # the merge, priced prefix by prefix (choose_n)
    heads = np.zeros(B, dtype=np.int64)
    taken = np.zeros(B, dtype=np.int64)
    e = np.float64(B)
    best_n, best_e = 0, e
    best_cost = draft_ms + verify_ms[1] + overhead_ms
    best_rate = best_e / best_cost
    widest = 1
    rows = np.empty(max(total, 1), dtype=np.int64)
    for i in range(1, total + 1):
        pick, a = -1, 0.0
        for b in range(B):  # the most likely next candidate; ties to the lower row
            if heads[b] < count[b]:
                x = acc[b, order[b, heads[b]]]
                if pick < 0 or x > a:
                    pick, a = b, x
        rows[i - 1] = pick
        heads[pick] += 1
        widest = max(widest, 1 + heads[pick])
        e += a
        cost = draft_ms + verify_ms[widest] + overhead_ms
        rate = e / cost
        if rate > best_rate:
            best_n, best_e, best_cost, best_rate = i, e, cost, rate
    for i in range(best_n):
        taken[rows[i]] += 1
    chosen[:] = taken
    return best_e, best_cost


def frontier_topk(score, depth, n_nodes, level, k):
    """Same contract as ``reference.frontier_topk``."""
    B = score.shape[0]
    nodes = np.empty((B, k), dtype=np.int64)
    count = np.empty(B, dtype=np.int64)
    frontier_rows(score.numpy(), depth.numpy(), n_nodes.numpy(), int(level), int(k), nodes, count)
    return torch.from_numpy(nodes), torch.from_numpy(count)


def prune_topn(score, n_nodes, budget):
    """Same contract as ``reference.prune_topn``."""
    kept = np.zeros(tuple(score.shape), dtype=np.bool_)
    prune_rows(score.numpy(), n_nodes.numpy(), int(budget), kept)
    return torch.from_numpy(kept)


def linearize(kept, n_nodes, parent, token, depth, exp_row, prefix_len, budget, max_depth) -> Linear:
    """Same contract as ``reference.linearize``."""
    return linearize_arrays(kept.numpy(), n_nodes.numpy(), parent.numpy(), token.numpy(), depth.numpy(),
                            exp_row.numpy(), prefix_len.numpy(), budget, max_depth)


def linearize_arrays(kept, n_nodes, parent, token, depth, exp_row, prefix_len, budget, max_depth) -> Linear:
    """``linearize`` of the tree's tables as numpy arrays (a run that has their views,
    ``ir.empty_host_tree``). The int64 tables filled with -1 are one allocation."""
    B = kept.shape[0]
    L, D = 1 + budget, max_depth
    W = (L + 63) // 64
    node, tok, pos, par, dep, erow, first = np.full((7, B, L), -1, dtype=np.int64)
    n = np.zeros(B, dtype=np.int64)
    n_children = np.zeros((B, L), dtype=np.int64)
    mask = np.zeros((B, L, L), dtype=np.bool_)
    bits = np.zeros((B, L, W), dtype=np.int64)
    paths = np.full((B, L, D + 1), -1, dtype=np.int64)
    n_paths = np.zeros(B, dtype=np.int64)
    linearize_rows(kept, n_nodes, parent, token, depth, exp_row, prefix_len, n, node, tok, pos, par, dep, erow,
                   first, n_children, mask, bits, paths, n_paths)
    P = max(n_paths.tolist())  # (a list: no numpy reduction for a few rows)
    t = torch.from_numpy
    return Linear(t(n), t(node), t(tok), t(pos), t(par), t(dep), t(mask), t(bits), t(paths[:, :P].copy()),
                  t(n_paths), t(first), t(n_children), t(erow))
