"""Pass ``cost_prune``: keep a node only while it pays for its verify cost (COST_MODEL.md).

Candidates are ranked exactly as ``prune`` ranks them (``rheoplan.ir.rank_key_order``:
higher score, then shallower, then created earlier), capped at ``budget``. Each gets
its estimated acceptance ``a_i`` (``rheoplan.costmodel.node_acceptance``: the calibrated
acceptance of its weight bucket times its parent's), and the tree keeps the best ``N*``
of them by ``rheoplan.costmodel.choose_n``, ``N = 0`` (a plain autoregressive step)
included. A prefix of the ranking is closed under ancestors, so the kept set is a tree.

Why this stays exact: the decision reads only the draft side (scores, weights, kinds:
for sampled slots the token-independent proxy) and the frozen ``CostPlan`` (timings
measured at load, the calibration as it stood before this step). It never sees the
target's output for this step, so it is one more reason to keep fewer nodes, like the
budget. The exact oracle covers it (``tests/planner/test_cost_prune.py``).

With B > 1 trees (the batched loop's live rows), the candidates of all rows compete for
one verify forward: rows are merged by estimated acceptance (each row in its own ranking
order) and each prefix of the merge is priced as the forward it would be, ``B`` rows padded
to the widest row (``Timings.verify_batch``), plus one batched draft call per depth
(``costmodel.draft_ms_batch``) and ``B`` rows' bookkeeping; the alternative is a plain
autoregressive step of all ``B`` rows. So trees shrink as the batch grows, down to plain
autoregressive steps when the verify forward is already compute-bound.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from rheoplan.costmodel import CostPlan, choose_n, draft_ms_batch, node_acceptance, slowest_row_tokens
from rheoplan.ir import DraftTree, rank_key_order
from rheoplan.pipeline import FnPass, PassContext


@dataclass(frozen=True)
class CostDecision:
    """What the cost model decided for one batch of trees (``decide``)."""

    est_accept: list[list[float]]  #: [B][n_nodes] estimated P(reached and accepted), root 1
    order: list[list[int]]  #: [B] candidate node ids in ranking order (capped at budget)
    chosen: list[int]  #: [B] N* drafted nodes kept per tree
    expected: float  #: E: expected emitted tokens of the whole batch (1 per tree + kept a_i)
    predicted_ms: float  #: predicted step latency: draft + verify(total tokens) + overhead
    ar_ms: float  #: predicted latency of a plain autoregressive step (no draft)
    draft_ms: float  #: the draft calls' share of ``predicted_ms``

    @property
    def pays(self) -> bool:
        """Did the best tree beat a plain autoregressive step (tokens per ms)? For a batch
        of B rows, with the slowest row's tokens (``slowest_row_tokens`` of the average
        row's ``expected / B``): a static batch waits for it."""
        B = len(self.chosen)
        return slowest_row_tokens(self.expected / B, B) / self.predicted_ms > 1.0 / self.ar_ms

    def text(self, b: int = 0) -> list[str]:
        """Comment lines for the text IR (the parser skips lines starting with '#')."""
        a = self.est_accept[b]
        kept = set(self.order[b][: self.chosen[b]])
        out = [f"# cost tree {b}: chosen N={self.chosen[b]} of {len(self.order[b])} candidates; "
               f"E={self.expected:.3f} tokens, predicted {self.predicted_ms:.2f} ms "
               f"(draft {self.draft_ms:.2f} ms) = {self.expected / self.predicted_ms * 1e3:.1f} tok/s; "
               f"AR step {self.ar_ms:.2f} ms = {len(self.chosen) / self.ar_ms * 1e3:.1f} tok/s; "
               f"{'tree pays' if self.pays else 'no tree pays'}"]
        for rank, v in enumerate(self.order[b], start=1):
            out.append(f"#   rank {rank}: %{v} est_accept={a[v]:.4f}{' kept' if v in kept else ''}")
        return out


def decide(plan: CostPlan, tree: DraftTree, budget: int) -> CostDecision:
    """The cost model's decision for ``tree`` (reads no ``kept`` flag, so it gives the same
    answer before and after pruning)."""
    B = tree.batch
    acc, orders = [], []
    for b in range(B):
        a = node_acceptance(plan, tree, b).tolist()
        ids = torch.arange(1, int(tree.n_nodes[b]), dtype=torch.int64)
        order = ids[rank_key_order(tree.score[b, ids], ids)].tolist()
        token = tree.token[b].tolist()
        order = [v for v in order if token[v] >= 0][:budget]
        acc.append(a)
        orders.append(order)
    # Merge the rows: repeatedly take the row whose next candidate is most likely accepted.
    heads = [0] * B
    merged, rows = [], []
    while True:
        best = max((b for b in range(B) if heads[b] < len(orders[b])),
                   key=lambda b: (acc[b][orders[b][heads[b]]], -b), default=None)
        if best is None:
            break
        merged.append(acc[best][orders[best][heads[best]]])
        rows.append(best)
        heads[best] += 1
    ctx = int(tree.prefix_len.max())
    draft = draft_ms_batch(plan, tree)
    tm = plan.timings
    # widest[N]: tokens of the widest row (root included) once the first N merged candidates
    # are kept; the verify forward is B rows padded to it
    widest, counts = [1], [0] * B
    for r in rows:
        counts[r] += 1
        widest.append(1 + max(counts))
    # every row emits at least one token, so a batch's step starts from B expected tokens
    n, e, cost = choose_n(merged, draft, lambda k: tm.verify_batch(B, widest[k - 1], ctx),
                          tm.tree_overhead(B, tree.cur_depth), base=B)
    chosen = [rows[:n].count(b) for b in range(B)]
    return CostDecision(acc, orders, chosen, e, cost, tm.ar_step_batch(B, ctx), draft)


class LastDecision:
    """``decide`` that remembers its last answer. One step's depth gates and its prune share
    one (``cost_pipeline``): when a gate declines a depth, the later passes return that
    very tree, and the prune would decide it again (~0.1 ms a step on the 2-core machine,
    most steps). The tree is matched by identity, as ``cost_expand_tree`` matches a
    declined one: passes return new trees and never write the one they were given."""

    def __init__(self, decide_fn=None) -> None:
        """``decide_fn``: an implementation of ``decide`` (the same answer, e.g. the numba
        one, ``rheoplan.kernels.plan.cpu_pass.decide``); default ``decide``."""
        self._last: tuple | None = None
        self._decide = decide if decide_fn is None else decide_fn

    def __call__(self, plan: CostPlan, tree: DraftTree, budget: int) -> CostDecision:
        last = self._last
        if last is not None and last[0] is plan and last[1] is tree and last[2] == budget:
            return last[3]
        d = self._decide(plan, tree, budget)
        self._last = (plan, tree, budget, d)
        return d


def cost_prune_tree(tree: DraftTree, ctx: PassContext, plan: CostPlan, on_decision=None,
                    decisions=None, views=None) -> DraftTree:
    """Keep the nodes the cost model chooses (``decide``; ``decisions``, a ``LastDecision``
    shared with the step's depth gates, reuses a decision they made for this tree).
    ``views``: numpy views of the tree's tables (``ir.empty_host_tree``) in a run that owns
    its tree (``ctx.in_place``): its ``kept`` table is written in place."""
    d = (decisions or decide)(plan, tree, ctx.tree_cfg.budget)
    if on_decision is not None:  # an observer (the decode loop's statistics); it changes nothing
        on_decision(d)
    if views is not None and ctx.in_place:
        kept = tree.kept
        k = views["kept"]
        k.fill(False)
    else:
        kept = torch.zeros_like(tree.kept)  # the only table this pass writes: the rest is shared
        k = kept.numpy() if kept.device.type == "cpu" else kept  # (host trees: numpy's scatter, no torch op)
    for b in range(tree.batch):
        k[b, d.order[b][: d.chosen[b]]] = True
        k[b, 0] = True
    return tree.replace(kept=kept)


def cost_prune(plan: CostPlan, on_decision=None, decisions: LastDecision | None = None) -> FnPass:
    """The pass, bound to one step's frozen ``CostPlan``; it replaces ``prune``.
    ``on_decision(CostDecision)``, if given, sees the decision (for statistics and dumps);
    ``decisions``: the ``LastDecision`` the step's depth gates share (``cost_pipeline``)."""
    return FnPass("prune", partial(cost_prune_tree, plan=plan, on_decision=on_decision, decisions=decisions))
