"""The default pipeline: reading it top to bottom explains the whole planner.

    expand@1, assign@1, expand@2, assign@2, ..., expand@D, assign@D, prune, linearize

Any pass can be removed, replaced or wrapped: it is only a list. It is the one list
``plan_tree``, ``plan_and_decode`` and the exact oracle run; each built-in pass names its
numba and Triton implementations next to itself, and ``rheoplan.pipeline.lower(passes,
backend)`` swaps them in (a pass of your own stays as written).
"""

from __future__ import annotations

from rheoplan.pipeline import Repeat
from rheoplan.planner.assign import assign_pass
from rheoplan.planner.cost_depth import cost_expand
from rheoplan.planner.cost_prune import LastDecision, cost_prune
from rheoplan.planner.expand import expand_pass
from rheoplan.planner.linearize import linearize_pass
from rheoplan.planner.prune import prune_pass

DEFAULT_PIPELINE = [
    Repeat("grow", (
        expand_pass,  # pick the frontier, draft it, create K slots each
        assign_pass,  # draw the sampled tokens, fill PAD slots
    ), times=lambda ctx: ctx.tree_cfg.depth),
    prune_pass,  # keep the best `budget` nodes
    linearize_pass,  # order, positions, masks, verifier tables
]


def cost_pipeline(plan, base=None, on_decision=None, decide=None, frontiers=None) -> list:
    """``base`` (default ``DEFAULT_PIPELINE``) made cost-aware for one step's frozen
    ``rheoplan.costmodel.CostPlan``: every ``expand`` is gated by ``cost_expand`` (stop
    drafting when another depth cannot pay) and ``prune`` is replaced by ``cost_prune``
    (keep a node only while it pays for its verify cost). Other passes are kept as given.
    ``on_decision`` observes the prune's ``CostDecision`` (see ``cost_prune``).
    ``decide``: the implementation of ``cost_prune.decide`` the gates and the prune call
    (default: that reference; the decode loop passes the numba one with ``backend='numba'``);
    ``frontiers``: likewise for ``cost_depth.frontiers``, the gates' frontier selection.

    Example:
        >>> from rheoplan.costmodel import Calibration, CostPlan, Timings
        >>> tm = Timings((1, 64), (10.0, 40.0), (12.0, 50.0), 0, 1000, (1,), (2.0,), 1.0, 1.0)
        >>> [p.name for p in cost_pipeline(CostPlan.from_calibration(tm, Calibration()))][-2:]
        ['prune', 'linearize']
    """
    decisions = LastDecision(decide)  # the prune reuses the decision behind a declined depth

    def rewrite(p):
        if isinstance(p, Repeat):
            return Repeat(p.name, tuple(rewrite(q) for q in p.body), p.times)
        if p.name == "expand":
            return cost_expand(plan, p, decisions, frontiers)
        if p.name == "prune":
            return cost_prune(plan, on_decision, decisions)
        return p

    return [rewrite(p) for p in (DEFAULT_PIPELINE if base is None else base)]
