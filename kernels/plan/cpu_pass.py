"""numba implementations of the ``prune`` and ``linearize`` passes (``backend='numba'``):
same names, same output as ``planner/prune.py`` and ``planner/linearize.py``."""

from __future__ import annotations

import numpy as np
import torch

from rheoplan.ir import DraftTree, LinearTree
from rheoplan.kernels.plan.cpu import linearize as linearize_kernel, prune_rows
from rheoplan.pipeline import PassContext


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
