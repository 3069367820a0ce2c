"""Pass ``cost_expand``: draft another depth only while it can pay for itself (COST_MODEL.md).

Wraps an ``expand`` pass. Before drafting depth ``d + 1`` it bounds the best gain that
depth could add, ``G = continuation[d] * sum of the frontier's estimated acceptances``
(``continuation[d]``: how often the walk went on below a reached node at depth ``d`` in
earlier steps), and compares the best tree without it (``rheoplan.costmodel.choose_n``
over the nodes drafted so far) with that tree plus ``G`` tokens at the price of one more
draft call over the frontier, one more verify token per frontier node and one more depth's
bookkeeping (``Timings.tree_overhead``: its passes, and the longer walk). When it cannot
pay, the pass returns the tree unchanged; the later ``expand`` passes see the same tree
and decide the same, so drafting stops there. Before depth 1 it follows the drafting
schedule: ``CostPlan.skip_draft`` makes the step a plain autoregressive one.

Like ``cost_prune`` it reads only the draft side and the frozen plan, never the target's
output for this step. With B rows (batched decoding) the bound is the batch's: every
row's frontier gain against one batched draft call and the padded verify forward it grows.
"""

from __future__ import annotations

from functools import partial

from rheoplan.costmodel import CostPlan
from rheoplan.ir import DraftTree
from rheoplan.pipeline import FnPass, PassContext
from rheoplan.planner.cost_prune import decide
from rheoplan.planner.expand import select_frontier


def frontiers(tree: DraftTree, k: int) -> list[list[int]]:
    """Per tree, the ``k`` nodes ``expand`` would draft next (``select_frontier``, best first).
    ``rheoplan.kernels.plan.cpu_pass.frontiers`` gives the same lists with one numba call."""
    return [select_frontier(tree, b, k) for b in range(tree.batch)]


def another_depth_pays(plan: CostPlan, tree: DraftTree, frontier: int, budget: int, decisions=None,
                       frontiers_fn=None) -> bool:
    """Can drafting one more depth below ``tree`` pay for its draft call and verify tokens?
    ``decisions``: a ``LastDecision`` shared with the step's prune (default: ``decide``);
    ``frontiers_fn``: an implementation of ``frontiers`` (default: that reference)."""
    d = tree.cur_depth
    if d == 0:
        return not plan.skip_draft
    if d >= len(plan.continuation):
        return False
    now = (decisions or decide)(plan, tree, budget)
    tm = plan.timings
    ctx = max(tree.prefix_len.tolist())
    B = tree.batch
    gain, width = 0.0, 0
    for b, f in enumerate((frontiers_fn or frontiers)(tree, frontier)):
        gain += plan.continuation[d] * sum(now.est_accept[b][v] for v in f)
        width = max(width, len(f))
    if width == 0:
        return False
    # the verify forward is B rows padded to the widest row; one more depth adds up to one
    # verify token per frontier node to it, within the budget
    row_now = 1 + max(now.chosen)
    row_more = min(row_now + width, 1 + budget)
    cost_more = (now.predicted_ms + tm.draft_batch(B, width)
                 + tm.verify_batch(B, row_more, ctx) - tm.verify_batch(B, row_now, ctx)
                 + tm.tree_overhead(B, d + 1) - tm.tree_overhead(B, d))
    return (now.expected + gain) / cost_more > now.expected / now.predicted_ms


def cost_expand_tree(tree: DraftTree, ctx: PassContext, plan: CostPlan, inner,
                     declined: list | None = None, decisions=None, frontiers_fn=None) -> DraftTree:
    """``inner(tree, ctx)`` if another depth pays, else ``tree`` unchanged. ``declined``
    (a list the pass owns) remembers the tree it last returned unchanged: the later
    ``expand`` passes of the run get that very tree back (``assign`` finds nothing to
    draw in it) and would decide the same, so they return it without deciding again
    (the decision is a third of a millisecond; a run has up to ``depth`` of them).
    ``decisions``: a ``LastDecision`` shared with the step's prune, which then reuses the
    decision behind a declined depth. ``frontiers_fn``: the backend's ``frontiers``."""
    if declined and declined[0] is tree:
        return tree
    cfg = ctx.tree_cfg
    if not another_depth_pays(plan, tree, cfg.frontier, cfg.budget, decisions, frontiers_fn):
        if declined is not None:
            declined[:] = [tree]
        return tree
    return inner(tree, ctx)


def cost_expand(plan: CostPlan, inner, decisions=None, frontiers_fn=None) -> FnPass:
    """``inner`` (an ``expand`` pass) gated by the cost model; it keeps the name ``expand``.
    ``decisions``: the ``LastDecision`` shared with the step's prune (``cost_pipeline``);
    ``frontiers_fn``: the backend's ``frontiers`` (default: the reference)."""
    return FnPass("expand", partial(cost_expand_tree, plan=plan, inner=inner, declined=[], decisions=decisions,
                                    frontiers_fn=frontiers_fn))
