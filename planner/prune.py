"""Pass ``prune``: global pruning (docs/method.md §4 step 3).

Keeps the root and the ``budget`` best drafted nodes by the global ranking (higher
score, then shallower, then created earlier: ``rheoplan.ir.rank_key_order``). A
child never outranks its parent (weights are <= 1 and children are created later),
so the kept set is closed under ancestors. Expansion rows (and the realised ``Y``)
of pruned or phantom nodes stay: the verifier needs ``Y`` even when the sampled
child itself was pruned.
"""

from __future__ import annotations

import torch

from rheoplan.ir import DraftTree, rank_key_order
from rheoplan.pipeline import PassContext, builtin_pass


def prune(tree: DraftTree, ctx: PassContext) -> DraftTree:
    t = tree.clone()
    t.kept.zero_()
    for b in range(t.batch):
        ids = torch.arange(1, int(t.n_nodes[b]), dtype=torch.int64)
        order = rank_key_order(t.score[b, ids], ids)
        t.kept[b, ids[order[: ctx.tree_cfg.budget]]] = True
        t.kept[b, 0] = True
    return t


#: the pass with its implementations: torch reference (above), numba CPU, Triton
prune_pass = builtin_pass("prune", prune,
                          numba="rheoplan.kernels.plan.cpu_pass:prune",
                          triton="rheoplan.kernels.plan.triton_pass:prune")
