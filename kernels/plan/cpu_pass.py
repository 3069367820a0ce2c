"""numba implementations of the ``prune`` and ``linearize`` passes (``backend='numba'``):
same names, same output as ``planner/prune.py`` and ``planner/linearize.py``; and of the
cost model's decision (``planner/cost_prune.decide``), which the cost passes take as
``cost_pipeline(decide=...)``."""

from __future__ import annotations

import numpy as np
import torch

from rheoplan.costmodel import CostPlan, Timings, draft_ms_so_far
from rheoplan.ir import DraftTree, LinearTree, NodeKind
from rheoplan.kernels.plan.cpu import cost_decide_row, linearize as linearize_kernel, prune_rows
from rheoplan.pipeline import PassContext
from rheoplan.planner.cost_prune import CostDecision, decide as reference_decide


def prune(tree: DraftTree, ctx: PassContext) -> DraftTree:
    """``planner.prune.prune``: global top-N by (score desc, id asc), numba selection."""
    kept = np.zeros(tuple(tree.kept.shape), dtype=np.bool_)
    prune_rows(tree.score.numpy(), tree.n_nodes.numpy(), ctx.tree_cfg.budget, kept)
    return tree.replace(kept=torch.from_numpy(kept))


def linearize(tree: DraftTree, ctx: PassContext) -> DraftTree:
    """``planner.linearize.linearize`` with the numba linearisation kernel."""
    lin = linearize_kernel(tree.kept, tree.n_nodes, tree.parent, tree.token, tree.depth, tree.exp_row,
                           tree.prefix_len, ctx.tree_cfg.budget, ctx.tree_cfg.depth)
    return tree.replace(linear=LinearTree(*lin))


#: the verify latencies of the last (timings, context) ``decide`` priced: one step's
#: gates and prune price the same context, and ``Timings.verify`` is two interpolations
_VERIFY_TABLE: dict[int, tuple[Timings, int, np.ndarray]] = {}


def _verify_table(tm: Timings, ctx: int, upto: int) -> np.ndarray:
    """``[Timings.verify(k, ctx) for k in 0..upto]`` (entry 0 unused), kept for the next call."""
    hit = _VERIFY_TABLE.get(id(tm))
    if hit is not None and hit[0] is tm and hit[1] == ctx and hit[2].shape[0] > upto:
        return hit[2]
    table = np.array([0.0] + [tm.verify(k, ctx) for k in range(1, upto + 1)])
    _VERIFY_TABLE.clear()
    _VERIFY_TABLE[id(tm)] = (tm, ctx, table)
    return table


def decide(plan: CostPlan, tree: DraftTree, budget: int) -> CostDecision:
    """``planner.cost_prune.decide`` with the numba kernel ``cost_decide_row`` for one tree
    (the same decision, bit for bit; a batch of trees goes to the reference, whose rows
    compete for one forward). The decode loop's cost passes use it with ``backend='numba'``."""
    if tree.batch != 1:
        return reference_decide(plan, tree, budget)
    tm = plan.timings
    ctx = int(tree.prefix_len[0])
    budget = int(budget)
    n = int(tree.n_nodes[0])
    table = np.asarray(plan.acceptance, dtype=np.float64)
    draft = draft_ms_so_far(plan, tree, 0)
    acc = np.zeros(tree.capacity, dtype=np.float64)
    order = np.empty(max(budget, 1), dtype=np.int64)
    cnt, chosen, e, cost = cost_decide_row(
        tree.kind[0].numpy(), tree.weight[0].numpy(), tree.parent[0].numpy(), tree.token[0].numpy(),
        tree.score[0].numpy(), n, table, int(NodeKind.SAMPLED), float(plan.scale), budget,
        _verify_table(tm, ctx, budget + 1), draft, tm.overhead_ms, acc, order)
    return CostDecision([acc.tolist()], [order[:cnt].tolist()], [chosen], e, cost, tm.ar_step(ctx), draft)
