"""Triton implementations of the ``expand`` and ``assign`` passes (``backend='triton'``).

Same names, same output as ``planner/expand.py`` and ``planner/assign.py``, on the
tree's device and without a host sync: every shape is known on the host beforehand
(``planner.expand.frontier_width``), every write is a scatter at device-computed
indices, and the broken-draft check is deferred to the end of planning
(``PassContext.deferred_checks``).

* ``expand``: the frontier by the Triton top-k kernel (``kernels/plan``), the draft call,
  the draft law by ``distributions.draft_probs`` (torch, the one definition), the
  ranked top-S by the Triton slot-expansion kernel (``probs=True``), then the tail mass,
  proxy and score rule from their one definitions, scattered into the tables.
* ``assign``: over all expansion rows at once, masked to the pending ones: the tail law
  (``distributions.tail_law_rows``), the sampler's batched Gumbel noise (the Triton
  Philox kernel for the default sampler) and ``argmax(log q~ + g)``; the SAMPLED and PAD
  slots are scattered. A sampler without the batch interface (the oracle's injected
  draws) is called row by row for the indices (host syncs); the writes are the same.
"""

from __future__ import annotations

import torch

from rheoplan.distributions import (BROKEN_DRAFT, broken_rows, draft_probs, draft_scores, tail_law, tail_law_rows,
                                    tail_mass)
from rheoplan.ir import DraftTree, NodeKind
from rheoplan.kernels.philox_triton import streams_uniform
from rheoplan.kernels.plan.triton import frontier_topk
from rheoplan.kernels.slot_expansion.triton import slot_expansion
from rheoplan.pipeline import PassContext
from rheoplan.planner.assign import has_sampled_slots
from rheoplan.planner.expand import (add_log_weight, check_can_expand, check_draft_logits, draft_columns,
                                     frontier_width, proxy_weights)


def expand(tree: DraftTree, ctx: PassContext) -> DraftTree:
    """``planner.expand.expand`` on the device."""
    cfg = ctx.tree_cfg
    check_can_expand(tree, ctx)
    K, m, B = tree.slots, tree.rheostat, tree.batch
    dev = tree.score.device
    width = frontier_width(cfg, K, tree.cur_depth)
    nodes, _ = frontier_topk(tree.score, tree.depth, tree.n_nodes, tree.cur_depth, width)
    logits, ids = draft_columns(ctx.draft(tree, nodes))
    V = check_draft_logits(logits, B, width, K, cfg.support)
    rows = logits.reshape(B * width, V).to(dev)
    bad = broken_rows(draft_scores(rows, ctx.sampling))  # after the division, as draft_probs checks
    ctx.deferred_checks.append((bad, BROKEN_DRAFT))  # raised at the end of planning, no sync here
    q = torch.where(bad, 1.0 / V, draft_probs(rows, ctx.sampling, check=False)).contiguous()
    s = min(cfg.support, V)
    R = B * width
    # top-S only (rheostat = slots: no draw here; assign draws)
    se = slot_expansion(q, torch.zeros(R, device=dev), torch.zeros(R, 1, dtype=torch.float64, device=dev),
                        temperature=1.0, support=s, rheostat=K, slots=K, probs=True)
    sup_tok, sup_q = se.sup_token, se.sup_q  # [R, s]
    if ids is not None:  # ranked columns of a SubsetLogits -> target ids
        sup_tok = ids.to(dev)[sup_tok]
    z64 = tail_mass(sup_q, m, s)
    pi = proxy_weights(cfg.proxy, sup_q, z64, m) if m < K else None

    b = torch.arange(B, device=dev).repeat_interleave(width)  # [R], b-major like the reference
    j = torch.arange(width, device=dev).repeat(B)
    v = nodes.reshape(-1)
    row = tree.n_expanded[b] + j
    t = tree.clone()
    t.expanded[b, v] = True
    t.exp_row[b, v] = row
    t.exp_node[b, row] = v
    t.sup_token[b, row, :s] = sup_tok
    t.sup_q[b, row, :s] = sup_q
    t.sup_n[b, row] = s
    t.z[b, row] = z64.to(torch.float32)
    t.n_expanded.add_(width)

    slots = torch.arange(K, device=dev)
    c = (tree.n_nodes[b] + j * K)[:, None] + slots  # [R, K] child ids
    bb = b[:, None].expand(R, K)
    t.parent[bb, c] = v[:, None].expand(R, K)
    t.depth[bb, c] = tree.cur_depth + 1
    t.slot[bb, c] = slots.expand(R, K)
    kind = torch.where(slots < m, int(NodeKind.DET), torch.where(slots == m, int(NodeKind.SAMPLED),
                                                                 int(NodeKind.PAD)))
    t.kind[bb, c] = kind.to(torch.int8).expand(R, K)
    base = tree.score[b, v]
    nd = min(m, K)
    if nd:  # DET: the s-th best token, weight = q
        cd, bd = c[:, :nd], bb[:, :nd]
        t.token[bd, cd] = sup_tok[:, :nd]
        t.q[bd, cd] = sup_q[:, :nd]
        t.weight[bd, cd] = sup_q[:, :nd]
        t.score[bd, cd] = add_log_weight(base[:, None].expand(R, nd), sup_q[:, :nd])
    if m < K:  # SAMPLED (proxy weight, or pending under true_q) and PAD (pending)
        cs = c[:, m]
        t.y_node[b, row] = cs
        w = pi.to(torch.float32)
        known = ~torch.isnan(pi)
        t.weight[b, cs] = torch.where(known, w, t.weight[b, cs])
        t.score[b, cs] = torch.where(known, add_log_weight(base, w), torch.full_like(w, float("nan")))
        if K - m - 1:
            t.score[bb[:, m + 1:], c[:, m + 1:]] = float("nan")
    t.n_nodes.add_(width * K)
    return t.replace(cur_depth=tree.cur_depth + 1, sup_width=s)


def assign(tree: DraftTree, ctx: PassContext) -> DraftTree:
    """``planner.assign.assign`` on the device, masked to the pending rows."""
    if not has_sampled_slots(tree, ctx):
        return tree
    K, m = tree.slots, tree.rheostat
    B, E, _ = tree.sup_q.shape
    S = tree.sup_width  # every row has S valid support entries (one vocabulary per plan)
    dev = tree.sup_q.device
    rows = torch.arange(E, device=dev)
    pending = (rows[None, :] < tree.n_expanded[:, None]) & (tree.y_token < 0)  # [B, E]
    qt = tail_law_rows(tree.sup_q.reshape(B * E, -1), m, S)  # [B*E, S-m], unused rows too
    if getattr(ctx.sampler, "gumbel_rows", None) is not None:
        trees = torch.arange(B, device=dev).repeat_interleave(E)
        g = ctx.sampler.gumbel_rows(trees, tree.exp_node.reshape(-1), S - m, streams_uniform)
        i = torch.argmax(torch.log(qt) + g, dim=1).reshape(B, E)  # tail index
    else:
        i = _indices_rowwise(tree, ctx, pending, m)
    yr = m + i  # support rank of Y
    y_tok = tree.sup_token.gather(2, yr[..., None])[..., 0]
    y_q = tree.sup_q.gather(2, yr[..., None])[..., 0]
    y_qt = qt.reshape(B, E, S - m).gather(2, i[..., None])[..., 0].to(torch.float32)

    t = tree.clone().replace(y_token=torch.where(pending, y_tok, tree.y_token),
                             y_qtilde=torch.where(pending, y_qt, tree.y_qtilde))
    # children of pending rows: SAMPLED at y_node, PAD right after it (ranks m.., skipping Y);
    # rows that are not pending write their current values back to node 0 (a no-op)
    c0 = torch.where(pending, tree.y_node, 0)  # [B, E]
    base = tree.score.gather(1, tree.exp_node.clamp(min=0))
    _put(t, pending, c0, y_tok, y_q, ctx.tree_cfg.proxy == "true_q", base)
    for jp in range(K - m - 1):
        r = m + jp + (m + jp >= yr).to(torch.int64)  # [B, E]
        tok = tree.sup_token.gather(2, r[..., None])[..., 0]
        qv = tree.sup_q.gather(2, r[..., None])[..., 0]
        _put(t, pending, torch.where(pending, c0 + 1 + jp, 0), tok, qv, True, base)
    return t


def _put(t: DraftTree, pending, c, tok, qv, weighted: bool, base) -> None:
    """Write token / q (and weight / score when ``weighted``) of child ids ``c [B, E]`` of
    pending rows; other rows rewrite node 0's own values."""
    keep = lambda new, field: torch.where(pending, new, field.gather(1, c))  # noqa: E731
    t.token.scatter_(1, c, keep(tok, t.token))
    t.q.scatter_(1, c, keep(qv, t.q))
    if weighted:
        t.weight.scatter_(1, c, keep(qv, t.weight))
        t.score.scatter_(1, c, keep(add_log_weight(base, qv), t.score))


def _indices_rowwise(tree: DraftTree, ctx: PassContext, pending, m: int) -> torch.Tensor:
    """A sampler without ``gumbel_rows`` (the oracle's injected draws): call it for each
    pending row, in the reference's order, with the reference's ``q~`` (host syncs)."""
    i = torch.zeros(pending.shape, dtype=torch.int64)
    for b, row in pending.nonzero().tolist():  # row-major = the reference's loop order
        law = tail_law(tree.sup_q[b, row].cpu(), m, int(tree.sup_n[b, row]))
        j = ctx.sampler(b, int(tree.exp_node[b, row]), law)
        if not 0 <= j < law.numel():
            raise ValueError(f"sampler returned tail index {j}, allowed [0, {law.numel()})")
        i[b, row] = j
    return i.to(pending.device)
