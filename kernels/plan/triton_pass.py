"""Triton implementations of the ``prune`` and ``linearize`` passes (``backend='triton'``):
same names, same output as ``planner/prune.py`` and ``planner/linearize.py``, on the
tree's device, with no host sync (``paths`` keeps its capacity ``[B, L, D+1]``; rows
past ``n_paths`` are -1, where the reference trims them)."""

from __future__ import annotations

from rheoplan.ir import DraftTree, LinearTree
from rheoplan.kernels.plan.triton import linearize as linearize_kernel, prune_topn
from rheoplan.pipeline import PassContext


def prune(tree: DraftTree, ctx: PassContext) -> DraftTree:
    """``planner.prune.prune``: global top-N by (score desc, id asc), one program per tree."""
    return tree.replace(kept=prune_topn(tree.score, tree.n_nodes, ctx.tree_cfg.budget))


def linearize(tree: DraftTree, ctx: PassContext) -> DraftTree:
    """``planner.linearize.linearize`` with the Triton linearisation kernel."""
    lin = linearize_kernel(tree.kept, tree.n_nodes, tree.parent, tree.token, tree.depth, tree.exp_row,
                           tree.prefix_len, ctx.tree_cfg.budget, ctx.tree_cfg.depth, trim_paths=False)
    return tree.replace(linear=LinearTree(*lin))
