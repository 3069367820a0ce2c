"""numba implementations of the ``prune`` and ``linearize`` passes (``backend='numba'``):
same names, same output as ``planner/prune.py`` and ``planner/linearize.py``; and of the
cost model's decision (``planner/cost_prune.decide``) and of the cost gates' frontier
(``planner/cost_depth.frontiers``), which the cost passes take as
``cost_pipeline(decide=..., frontiers=...)``."""

from __future__ import annotations

import numpy as np
import torch

from rheoplan.costmodel import CostPlan, Timings, draft_ms_of_depths
from rheoplan.ir import DraftTree, LinearTree, NodeKind, host_table
from rheoplan.kernels.plan.cpu import (cost_decide_rows, draft_depth_widths, frontier_rows, linearize_arrays,
                                       prune_rows)
from rheoplan.pipeline import PassContext
from rheoplan.planner.cost_prune import CostDecision


def prune(tree: DraftTree, ctx: PassContext) -> DraftTree:
    """``planner.prune.prune``: global top-N by (score desc, id asc), numba selection."""
    kept = np.zeros(tuple(tree.kept.shape), dtype=np.bool_)
    prune_rows(tree.score.numpy(), tree.n_nodes.numpy(), ctx.tree_cfg.budget, kept)
    return tree.replace(kept=torch.from_numpy(kept))


def linearize(tree: DraftTree, ctx: PassContext, views: dict[str, np.ndarray] | None = None) -> DraftTree:
    """``planner.linearize.linearize`` with the numba linearisation kernel. ``views``:
    numpy views of the tree's tables (``ir.empty_host_tree``), when the caller has them."""
    lin = linearize_arrays(*(host_table(tree, n, views) for n in _LINEARIZE_READS), ctx.tree_cfg.budget,
                           ctx.tree_cfg.depth)
    return tree.replace(linear=LinearTree(*lin))


_LINEARIZE_READS = ("kept", "n_nodes", "parent", "token", "depth", "exp_row", "prefix_len")


#: the verify latencies of the last (timings, rows, context) ``decide`` priced: one step's
#: gates and prune price the same, and each ``Timings.verify_batch`` is a few interpolations
_VERIFY_TABLE: dict[int, tuple[Timings, int, int, np.ndarray]] = {}
#: one row: ``Timings.verify_ends`` of 1..k tokens, which do not change with the context, so
#: a step prices its curve with three numpy ops instead of k interpolations
_VERIFY_ENDS: dict[int, tuple[Timings, np.ndarray, np.ndarray]] = {}


def _verify_table(tm: Timings, batch: int, ctx: int, upto: int) -> np.ndarray:
    """``[Timings.verify_batch(batch, k, ctx) for k in 0..upto]`` (entry 0 unused), kept
    for the next call; the same bits (``Timings.at_ctx`` on arrays does the float64 ops of
    ``Timings.verify`` in the same order)."""
    hit = _VERIFY_TABLE.get(id(tm))
    if hit is not None and hit[0] is tm and hit[1:3] == (batch, ctx) and hit[3].shape[0] > upto:
        return hit[3]
    if batch == 1:
        ends = _VERIFY_ENDS.get(id(tm))
        if ends is None or ends[0] is not tm or ends[1].shape[0] <= upto:
            lo_hi = [tm.verify_ends(k) for k in range(1, upto + 1)]
            ends = (tm, np.array([0.0] + [a for a, _ in lo_hi]), np.array([0.0] + [b for _, b in lo_hi]))
            _VERIFY_ENDS.clear()
            _VERIFY_ENDS[id(tm)] = ends
        table = np.maximum(tm.at_ctx(ends[1][:upto + 1], ends[2][:upto + 1], ctx), 1e-3)
        table[0] = 0.0
    else:
        table = np.array([0.0] + [tm.verify_batch(batch, k, ctx) for k in range(1, upto + 1)])
    _VERIFY_TABLE.clear()
    _VERIFY_TABLE[id(tm)] = (tm, batch, ctx, table)
    return table


def decide(plan: CostPlan, tree: DraftTree, budget: int, views: dict[str, np.ndarray] | None = None) -> CostDecision:
    """``planner.cost_prune.decide`` with the numba kernel ``cost_decide_rows``: the same
    decision, bit for bit, for one tree or a batch. The decode loop's cost passes use it
    with ``backend='numba'``. ``views``: numpy views of ``tree``'s tables
    (``ir.empty_host_tree``), when the caller has them."""
    tm = plan.timings
    B = tree.batch

    def v(name: str) -> np.ndarray:
        return host_table(tree, name, views)

    ctx = max(v("prefix_len").tolist())  # (a list: no reduction for a few rows)
    budget = int(budget)
    widest = np.empty(tree.cur_depth + 1, dtype=np.int64)
    draft_depth_widths(v("n_expanded"), v("exp_node"), v("depth"), widest)
    draft = draft_ms_of_depths(tm, B, widest.tolist())  # as costmodel.draft_ms_batch
    acc = np.zeros((B, tree.capacity), dtype=np.float64)
    order = np.empty((B, max(budget, 1)), dtype=np.int64)
    count = np.empty(B, dtype=np.int64)
    chosen = np.empty(B, dtype=np.int64)
    e, cost = cost_decide_rows(
        v("kind"), v("weight"), v("parent"), v("token"), v("score"), v("n_nodes"),
        np.asarray(plan.acceptance, dtype=np.float64), int(NodeKind.SAMPLED),
        float(plan.scale), budget, _verify_table(tm, B, ctx, budget + 1), draft, tm.tree_overhead(B, tree.cur_depth),
        acc, order, count, chosen)
    orders = [order[b, :c].tolist() for b, c in enumerate(count.tolist())]
    return CostDecision(acc.tolist(), orders, chosen.tolist(), e, cost, tm.ar_step_batch(B, ctx), draft)


def frontiers(tree: DraftTree, k: int, views: dict[str, np.ndarray] | None = None) -> list[list[int]]:
    """``planner.cost_depth.frontiers`` (the cost gates' frontier: the ``k`` best nodes of
    the deepest level of each tree) with the numba selection the ``expand`` pass uses: the
    same lists, with one kernel call instead of a sort per tree. ``views``: as ``decide``'s."""
    B = tree.batch
    nodes = np.empty((B, max(int(k), 1)), dtype=np.int64)
    count = np.empty(B, dtype=np.int64)
    frontier_rows(host_table(tree, "score", views), host_table(tree, "depth", views),
                  host_table(tree, "n_nodes", views), tree.cur_depth, int(k), nodes, count)
    return [nodes[b, :c].tolist() for b, c in enumerate(count.tolist())]
