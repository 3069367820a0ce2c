"""numba implementations of the ``expand`` and ``assign`` passes (``backend='numba'``).

Same names, same output as ``planner/expand.py`` and ``planner/assign.py``: the
``DraftTree`` after each pass equals the reference's tensor for tensor for the same seed
(``tests/rheoplan/test_lower.py``). The kernels do the selection
(``frontier_rows``, ``rank_support_rows``) and the table writes; every formula comes from
its one definition: the draft law (``distributions.draft_probs``; its broken-law check in
``rank_support_rows``), the tail mass and tail law (``distributions.tail_mass`` /
``tail_law_rows``), the proxy (``planner.expand.proxy_weights``, through its pinned numba
port ``cpu.proxy_weight``), the score rule (``add_log_weight``: its log in torch, its
float64 add in ``_add_scores``) and the sampled slots' draws (the sampler's
``stream_rows`` names the streams; ``cpu.tail_draws`` reads them as it draws).
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit

from rheoplan.config import PROXY_CODES
from rheoplan.distributions import BROKEN_DRAFT, draft_probs, tail_law, tail_mass
from rheoplan.ir import DraftTree, NodeKind, host_table
from rheoplan.kernels.noise import counter_rows
from rheoplan.kernels.plan.cpu import frontier_rows
from rheoplan.kernels.slot_expansion.cpu import proxy_weight, rank_support_rows, tail_draw_row, tail_draws
from rheoplan.pipeline import PassContext
from rheoplan.planner.assign import has_sampled_slots
from rheoplan.planner.expand import check_can_expand, check_draft_logits, draft_columns
from rheoplan.rng import philox_counter

_DET, _SAMPLED, _PAD = int(NodeKind.DET), int(NodeKind.SAMPLED), int(NodeKind.PAD)


def _clone(tree: DraftTree, names: tuple[str, ...], in_place: bool = False,
           views: dict[str, np.ndarray] | None = None) -> tuple[DraftTree, list[np.ndarray]]:
    """A new tree whose ``names`` tensors are fresh copies (the others are shared and
    not written: passes stay pure without copying all ~25 tensors), and the copies as
    numpy arrays, in ``names`` order, for the kernels to write (one numpy copy per field
    instead of a torch clone and a ``.numpy()`` view of it). ``in_place``
    (``PassContext.in_place``: the run owns its trees): no copies, a new tree object over
    the same tensors and views of them, so the kernels write the given tree's tables;
    ``views``: those views already made (``ir.empty_host_tree``)."""
    if in_place:
        if views is not None:
            return tree.replace(), [views[n] for n in names]
        return tree.replace(), [getattr(tree, n).numpy() for n in names]
    arrays = [getattr(tree, n).numpy().copy() for n in names]
    return tree.replace(**{n: torch.from_numpy(a) for n, a in zip(names, arrays)}), arrays


@njit(cache=True)
def _add_scores(score, parent, out_b, out_c, logw):
    """``add_log_weight`` after its log: ``score[b, c] = float32(float64(score[b, parent])
    + float64(logw))`` for the listed children (their parents are a level up, scored)."""
    for i in range(logw.shape[0]):
        b, c = out_b[i], out_c[i]
        score[b, c] = np.float32(np.float64(score[b, parent[b, c]]) + np.float64(logw[i]))


def _score_children(t: DraftTree, out_b, out_c, wbuf, n1: int, n2: int = 0, views=None) -> None:
    """``score[c] = add_log_weight(score[parent(c)], w)`` for the listed children
    ``[0, n1)`` and ``[n1, n1 + n2)`` (one pass's list, or ``expand_assign``'s two: the
    expand's, then the assign's). The log in torch, as the rule takes it (numba's glibc log
    differs from torch's in the last bit for ~0.1% of inputs, ``kernels/slot_expansion/cpu.py``),
    each list's in one call as the separate passes take them (the same positions in the
    same calls: the same bits), in place in ``wbuf``; the adds and the rounding in one
    kernel call instead of five indexing ops (the same bits: the parity tests). ``views``:
    the tree's numpy views, when the run has them."""
    n = n1 + n2
    if n1:
        torch.from_numpy(wbuf[:n1]).log_()
    if n2:
        torch.from_numpy(wbuf[n1:n]).log_()
    if n:
        _add_scores(host_table(t, "score", views), host_table(t, "parent", views), out_b[:n], out_c[:n], wbuf[:n])


# -- expand -------------------------------------------------------------------------------


@njit(cache=True)
def _frontier_rows(nodes, count, rows_b, rows_v):
    """Flatten the -1 padded frontier ``nodes [B, w]`` into (tree, node) rows, b-major."""
    r = 0
    for b in range(nodes.shape[0]):
        for j in range(count[b]):
            rows_b[r] = b
            rows_v[r] = nodes[b, j]
            r += 1
    return r


@njit(cache=True)
def _expand_write(rows_b, rows_v, sup_tok, sup_q, s, z64, proxy, m, K, level,
                  n_nodes, n_expanded, expanded, exp_row, exp_node, t_sup_token, t_sup_q, t_sup_n, t_z,
                  parent, depth, slot, kind, token, q, weight, score, y_node, out_b, out_c, wbuf):
    """Create the K slots of every frontier row (``planner.expand`` body). Children whose
    weight is known get ``(b, c, w)`` in ``out_b/out_c/wbuf`` for scoring; the pending
    ones (PAD, and SAMPLED when the proxy weight is NaN) get a NaN score like the
    reference. ``proxy``: the policy's ``config.PROXY_CODES`` code (``cpu.proxy_weight``).
    Returns how many were listed."""
    ns = 0
    for r in range(rows_b.shape[0]):
        b, v = rows_b[r], rows_v[r]
        row = n_expanded[b]
        n_expanded[b] += 1
        expanded[b, v] = True
        exp_row[b, v] = row
        exp_node[b, row] = v
        t_sup_token[b, row, :s] = sup_tok[r]
        t_sup_q[b, row, :s] = sup_q[r]
        t_sup_n[b, row] = s
        t_z[b, row] = np.float32(z64[r])
        for sl in range(K):
            c = n_nodes[b]
            n_nodes[b] += 1
            parent[b, c] = v
            depth[b, c] = level + 1
            slot[b, c] = sl
            if sl < m:
                kind[b, c] = _DET
                token[b, c] = sup_tok[r, sl]
                q[b, c] = sup_q[r, sl]
                weight[b, c] = sup_q[r, sl]
            elif sl == m:
                kind[b, c] = _SAMPLED
                y_node[b, row] = c
                pi = proxy_weight(proxy, sup_q[r], z64[r], m)
                if np.isnan(pi):
                    score[b, c] = np.nan
                    continue
                weight[b, c] = np.float32(pi)
            else:
                kind[b, c] = _PAD
                score[b, c] = np.nan
                continue
            out_b[ns] = b
            out_c[ns] = c
            wbuf[ns] = weight[b, c]
            ns += 1
    return ns


_EXPAND_FIELDS = ("n_nodes", "n_expanded", "expanded", "exp_row", "exp_node", "sup_token", "sup_q",
                  "sup_n", "z", "parent", "depth", "slot", "kind", "token", "q", "weight", "score", "y_node")


def expand(tree: DraftTree, ctx: PassContext) -> DraftTree:
    """``planner.expand.expand`` with numba frontier selection, top-S and slot writes."""
    return _expand(tree, ctx)[0]


def _expand_rows(tree: DraftTree, ctx: PassContext, views: dict[str, np.ndarray] | None = None):
    """What ``expand`` writes into the tree: its rows' trees and nodes ``rows_b, rows_v
    [R]`` (b-major: the order ``_pending_rows`` lists them in), their ranked support
    ``sup_tok, sup_q [R, S']`` (numpy; target ids, float32), ``S'`` and their tail masses
    ``z64 [R]`` (float64 tensor, ``tail_mass``): the frontier, the draft call, the law.
    ``views``: the tree's numpy views (``ir.empty_host_tree``), when the run has them."""
    cfg = ctx.tree_cfg
    check_can_expand(tree, ctx)
    K, m, B = tree.slots, tree.rheostat, tree.batch
    k = 1 if tree.cur_depth == 0 else cfg.frontier
    nodes_np = np.empty((B, k), dtype=np.int64)
    count = np.empty(B, dtype=np.int64)
    frontier_rows(host_table(tree, "score", views), host_table(tree, "depth", views),
                  host_table(tree, "n_nodes", views), tree.cur_depth, k, nodes_np, count)
    width = max(count.tolist())  # (a list: no numpy reduction for a few rows)
    nodes = torch.from_numpy(nodes_np[:, :width].copy())
    logits, ids = draft_columns(ctx.draft(tree, nodes))
    V = check_draft_logits(logits, B, width, K, cfg.support)
    rows_b = np.empty(B * width, dtype=np.int64)
    rows_v = np.empty(B * width, dtype=np.int64)
    R = _frontier_rows(nodes_np, count, rows_b, rows_v)
    rows = logits.reshape(B * width, V) if R == B * width else logits[nodes.to(logits.device) >= 0]  # b-major
    # row-wise: same bits as per-tree calls; the broken-law check in the ranking kernel
    q = draft_probs(rows.to(device="cpu"), ctx.sampling, check=False).contiguous()
    s = min(cfg.support, V)
    sup_tok = np.empty((R, s), dtype=np.int64)
    sup_q = np.empty((R, s), dtype=np.float32)
    if rank_support_rows(q.numpy(), s, sup_tok, sup_q):
        raise ValueError(BROKEN_DRAFT)
    if ids is not None:  # ranked columns of a SubsetLogits -> target ids
        sup_tok = ids.cpu().numpy()[sup_tok]
    return rows_b[:R], rows_v[:R], sup_tok, sup_q, s, tail_mass(torch.from_numpy(sup_q), m, s)


def _expand(tree: DraftTree, ctx: PassContext, views: dict[str, np.ndarray] | None = None):
    """``expand``'s tree, and what ``expand_assign`` draws from: its rows' trees and nodes,
    their ranked support probabilities ``[R, S']`` and tail masses (``_expand_rows``;
    ``views`` as there)."""
    rows_b, rows_v, sup_tok, sup_q, s, z64 = _expand_rows(tree, ctx, views)
    K, m, R = tree.slots, tree.rheostat, len(rows_b)
    t, a = _clone(tree, _EXPAND_FIELDS, ctx.in_place, views)
    out_b = np.empty(R * K, dtype=np.int64)
    out_c = np.empty(R * K, dtype=np.int64)
    wbuf = np.empty(R * K, dtype=np.float32)
    ns = _expand_write(rows_b, rows_v, sup_tok, sup_q, s, z64.numpy(), PROXY_CODES[ctx.tree_cfg.proxy], m, K,
                       tree.cur_depth, *a, out_b, out_c, wbuf)
    _score_children(t, out_b, out_c, wbuf, ns, views=views)
    return t.replace(cur_depth=tree.cur_depth + 1, sup_width=s), rows_b, rows_v, torch.from_numpy(sup_q), z64


# -- assign -------------------------------------------------------------------------------


@njit(cache=True)
def _pending_rows(n_expanded, y_token, exp_node, sup_n, m, bi, ri, nodes, n_tail):
    """Expansion rows whose Y is not drawn yet, b-major (the reference's loop order)."""
    R = 0
    for b in range(n_expanded.shape[0]):
        for row in range(n_expanded[b]):
            if y_token[b, row] < 0:
                bi[R] = b
                ri[R] = row
                nodes[R] = exp_node[b, row]
                n_tail[R] = sup_n[b, row] - m
                R += 1
    return R


@njit(cache=True, inline="always")
def _assign_row(b, row, y_tail, y_qt, m, K, proxy_true_q, sup_token, sup_q, y_node,
                token, q, weight, y_token, y_qtilde, out_b, out_c, wbuf, ns):
    """Fill the SAMPLED and PAD slots of expansion row ``row`` of tree ``b`` given its draw
    (tail index ``y_tail``, ``q~`` of it ``y_qt``); children to score are listed from
    ``out_b/out_c/wbuf[ns]`` on. Returns the new count."""
    yr = m + y_tail
    y_token[b, row] = sup_token[b, row, yr]
    y_qtilde[b, row] = np.float32(y_qt)
    c = y_node[b, row]
    token[b, c] = sup_token[b, row, yr]
    q[b, c] = sup_q[b, row, yr]
    if proxy_true_q:
        weight[b, c] = sup_q[b, row, yr]
        out_b[ns], out_c[ns], wbuf[ns] = b, c, weight[b, c]
        ns += 1
    p = c + 1
    rank = m
    while p < c + K - m:  # PAD: tail ranks in order, skipping Y
        if rank != yr:
            token[b, p] = sup_token[b, row, rank]
            q[b, p] = sup_q[b, row, rank]
            weight[b, p] = sup_q[b, row, rank]
            out_b[ns], out_c[ns], wbuf[ns] = b, p, weight[b, p]
            ns += 1
            p += 1
        rank += 1
    return ns


@njit(cache=True)
def _assign_write(bi, ri, y_tail, y_qt, m, K, proxy_true_q, sup_token, sup_q, y_node,
                  token, q, weight, y_token, y_qtilde, out_b, out_c, wbuf):
    """Fill the SAMPLED and PAD slots of each drawn row (``planner.assign`` body)."""
    ns = 0
    for r in range(bi.shape[0]):
        ns = _assign_row(bi[r], ri[r], y_tail[r], y_qt[r], m, K, proxy_true_q, sup_token, sup_q, y_node,
                         token, q, weight, y_token, y_qtilde, out_b, out_c, wbuf, ns)
    return ns


_ASSIGN_FIELDS = ("token", "q", "weight", "score", "y_token", "y_qtilde")


def draw_rows(sampler, sup_q: torch.Tensor, trees: torch.Tensor, nodes: torch.Tensor, m: int,
              n_tail: torch.Tensor, z: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Tail index and ``q~`` of the draw of every row of ``sup_q [R, S]`` (``z``: their tail
    masses when the caller has them, ``tail_mass`` of the same rows; see ``tail_draws``).

    With a sampler that names its rows' streams (``stream_rows``: the default sampler),
    one numba call draws every row straight from its stream
    (``kernels.slot_expansion.cpu.tail_draws``), exactly the per-row draw. Otherwise the
    sampler is called row by row with the same ``q~`` tensor the reference passes.
    """
    R = sup_q.shape[0]
    stream_rows = getattr(sampler, "stream_rows", None)
    nt = n_tail.tolist()  # a host check: no torch op or numpy reduction for a few rows
    if stream_rows is not None and R > 0 and nt.count(nt[0]) == R:
        seed, steps, ids, purpose = stream_rows(trees, nodes)
        steps = steps if isinstance(steps, int) else steps.numpy()
        return tail_draws(sup_q, m, int(nt[0]), seed, counter_rows(steps, ids.numpy(), nodes.numpy(), purpose), z)
    i = torch.empty(R, dtype=torch.int64)
    y_qt = torch.empty(R, dtype=torch.float64)
    for r in range(R):
        law = tail_law(sup_q[r], m, m + int(n_tail[r]))
        j = sampler(int(trees[r]), int(nodes[r]), law)
        if not 0 <= j < law.numel():
            raise ValueError(f"sampler returned tail index {j}, allowed [0, {law.numel()})")
        i[r], y_qt[r] = j, float(law[j])
    return i, y_qt


def assign(tree: DraftTree, ctx: PassContext) -> DraftTree:
    """``planner.assign.assign`` with batched draws and slot writes."""
    if not has_sampled_slots(tree, ctx):
        return tree
    m = tree.rheostat
    cap = tree.batch * tree.exp_node.shape[1]
    bi, ri, nodes, n_tail = (np.empty(cap, dtype=np.int64) for _ in range(4))
    R = _pending_rows(tree.n_expanded.numpy(), tree.y_token.numpy(), tree.exp_node.numpy(),
                      tree.sup_n.numpy(), m, bi, ri, nodes, n_tail)
    if R == 0:
        return tree
    bi, ri, nodes, n_tail = bi[:R], ri[:R], nodes[:R], n_tail[:R]
    sq = torch.from_numpy(tree.sup_q.numpy()[bi, ri])  # (numpy's gather: no torch indexing op)
    return _draw_fill(tree, ctx, bi, ri, nodes, n_tail, sq)


def _draw_fill(tree: DraftTree, ctx: PassContext, bi, ri, nodes, n_tail, sq: torch.Tensor,
               z: torch.Tensor | None = None) -> DraftTree:
    """``assign``'s draws and writes for its pending rows ``(bi, ri)`` (expansion node
    ``nodes``, ``n_tail`` tail ranks, ranked support ``sq``; ``z``: their tail masses, when
    the caller has them)."""
    K, m, R = tree.slots, tree.rheostat, len(bi)
    y_tail, y_qt = draw_rows(ctx.sampler, sq, torch.from_numpy(bi), torch.from_numpy(nodes), m,
                             torch.from_numpy(n_tail), z)
    t, (token, q, weight, _, y_token, y_qtilde) = _clone(tree, _ASSIGN_FIELDS, ctx.in_place)
    out_b = np.empty(R * K, dtype=np.int64)
    out_c = np.empty(R * K, dtype=np.int64)
    wbuf = np.empty(R * K, dtype=np.float32)
    ns = _assign_write(bi, ri, y_tail.numpy(), y_qt.numpy(), m, K, ctx.tree_cfg.proxy == "true_q",
                       tree.sup_token.numpy(), tree.sup_q.numpy(), tree.y_node.numpy(), token, q, weight,
                       y_token, y_qtilde, out_b, out_c, wbuf)
    _score_children(t, out_b, out_c, wbuf, ns)
    return t


#: the numba Philox counter of one draw: ``rng.philox_counter`` itself, compiled (int64
#: words, wrapped as ``kernels.noise.counter_rows`` wraps them)
_philox_counter = njit(cache=True)(philox_counter)


@njit(cache=True)
def _expand_draw_write(rows_b, rows_v, sup_tok, sup_q, s, z64, proxy, m, K, level,
                       n_nodes, n_expanded, expanded, exp_row, exp_node, t_sup_token, t_sup_q, t_sup_n, t_z,
                       parent, depth, slot, kind, token, q, weight, score, y_node, y_token, y_qtilde,
                       proxy_true_q, k0, steps, ids, purpose, out_b, out_c, wbuf):
    """``_expand_write``, then each row's sampled slot drawn from its stream (counter
    ``philox_counter(steps[r], ids[r], rows_v[r], purpose)``, ``cpu.tail_draw_row``: the
    draw of ``tail_draws``) and written as ``_assign_write`` writes it, in one call.
    Returns how many children the expand listed for scoring and how many the assign
    listed after them."""
    ns = _expand_write(rows_b, rows_v, sup_tok, sup_q, s, z64, proxy, m, K, level,
                       n_nodes, n_expanded, expanded, exp_row, exp_node, t_sup_token, t_sup_q, t_sup_n, t_z,
                       parent, depth, slot, kind, token, q, weight, score, y_node, out_b, out_c, wbuf)
    nt = s - m
    buf = np.empty(4, dtype=np.uint64)
    qt = np.empty(max(nt, 1))
    na = ns
    for r in range(rows_b.shape[0]):
        b, v = rows_b[r], rows_v[r]
        ctr = _philox_counter(steps[r], ids[r], v, purpose)
        i = tail_draw_row(sup_q[r], m, nt, z64[r], k0, np.uint64(ctr[1]), np.uint64(ctr[2]), np.uint64(ctr[3]),
                          qt, buf)
        na = _assign_row(b, exp_row[b, v], i, qt[i], m, K, proxy_true_q, t_sup_token, t_sup_q, y_node,
                         token, q, weight, y_token, y_qtilde, out_b, out_c, wbuf, na)
    return ns, na - ns


_EXPAND_ASSIGN_FIELDS = _EXPAND_FIELDS + ("y_token", "y_qtilde")


def expand_assign(tree: DraftTree, ctx: PassContext, views: dict[str, np.ndarray] | None = None) -> DraftTree:
    """``assign(expand(tree, ctx), ctx)``, the same tree, in one call (the fused cost
    pipeline, ``kernels.plan.cpu_pipeline``). ``assign`` draws the rows whose sampled
    slot is pending, and after ``expand`` those are exactly the rows it just made (every
    earlier row was drawn by the ``assign`` after its own ``expand``), in the same order;
    so this draws them from ``expand``'s own support table and tail masses (the same
    values, the same sums: ``tail_mass`` of the same numbers), without scanning the
    tree for them, gathering their rows or summing their tails again. With the default
    sampler (its ``stream_rows`` names each row's stream) the writes, draws and slot
    fills are one kernel call (``_expand_draw_write``); another sampler is called row by
    row as ``assign`` calls it. ``views``: numpy views of ``tree``'s tables
    (``ir.empty_host_tree``) for a run that writes its tree in place (``ctx.in_place``)."""
    if views is not None and not ctx.in_place:
        raise ValueError("views are for a run that writes its tree in place: need ctx.in_place")
    sampled = has_sampled_slots(tree, ctx)
    stream_rows = getattr(ctx.sampler, "stream_rows", None)
    if not sampled or stream_rows is None:
        t, rows_b, rows_v, sup_q, z64 = _expand(tree, ctx, views)
        R = len(rows_b)
        if not sampled or R == 0:
            return t
        ri = t.exp_row.numpy()[rows_b, rows_v]
        n_tail = np.array([t.sup_width - t.rheostat] * R, dtype=np.int64)
        return _draw_fill(t, ctx, rows_b, ri, rows_v, n_tail, sup_q, z64)
    rows_b, rows_v, sup_tok, sup_q, s, z64 = _expand_rows(tree, ctx, views)
    K, m, R = tree.slots, tree.rheostat, len(rows_b)
    seed, steps, ids, purpose = stream_rows(torch.from_numpy(rows_b), torch.from_numpy(rows_v))
    steps = np.full(R, steps, dtype=np.int64) if isinstance(steps, int) else steps.numpy()
    t, a = _clone(tree, _EXPAND_ASSIGN_FIELDS, ctx.in_place, views)
    out_b = np.empty(2 * R * K, dtype=np.int64)
    out_c = np.empty(2 * R * K, dtype=np.int64)
    wbuf = np.empty(2 * R * K, dtype=np.float32)
    n1, n2 = _expand_draw_write(rows_b, rows_v, sup_tok, sup_q, s, z64.numpy(), PROXY_CODES[ctx.tree_cfg.proxy], m,
                                K, tree.cur_depth, *a, ctx.tree_cfg.proxy == "true_q", np.uint64(seed), steps,
                                ids.numpy(), purpose, out_b, out_c, wbuf)
    _score_children(t, out_b, out_c, wbuf, n1, n2, views)
    return t.replace(cur_depth=tree.cur_depth + 1, sup_width=s)
