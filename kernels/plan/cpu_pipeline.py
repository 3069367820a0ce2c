"""The decode's cost-aware pass list lowered to ``backend='numba'`` as one function.

``planner.default.cost_pipeline`` over ``DEFAULT_PIPELINE``, lowered to numba, is

    expand@1 (gated), assign@1, ..., expand@D (gated), assign@D, cost_prune, linearize

run by ``rheoplan.pipeline.run_pipeline``: each pass copies the tables it writes (passes
are pure, so an instrument or a pass of your own may keep any tree it saw), and the run
goes through the pass objects, the ``Repeat`` block and the instrument hooks. When nothing
watches (no instrument, only these built-in passes: the decode loop's own plan), no tree
but the last is ever read again, so ``plan_cost_tree`` runs the same passes in the same
order with the run owning its trees (``PassContext.in_place``: the numba ``expand`` and
``assign`` write the tree they are given) and without the pass machinery. Its tree is built
with numpy views of its tables (``ir.empty_host_tree``), which the kernels of every depth
write and read through instead of calling ``.numpy()`` on each table for each call. The kernels,
the formulas and their order are the passes' own, so the tree is the pipeline's, table
for table, and so is the cost decision (``tests/kernels/plan/test_cpu_pipeline.py``).

Why: a one-row step plans about two depths, and each pass's copies and the machinery
around it are operations the interpreter runs cold after each forward: at T = 1 on the
2-core Zen 4 EPYC a step's plan took 1.51 ms through the pass list and 1.25 fused
(interleaved; with ``expand_assign``, which also skips the second pass's scan, gather
and tail sums; docs/results.md, "Thirty-fourth round"); then 1.15 -> 0.81 ms with the
views, the arena and a depth's writes, draws and fills in one kernel call ("Thirty-fifth
round").
"""

from __future__ import annotations

from functools import partial
from typing import Callable, Sequence

import torch

from rheoplan.config import SamplingConfig, TreeConfig
from rheoplan.costmodel import CostPlan
from rheoplan.ir import DraftTree, HostTreeArena, empty_host_tree
from rheoplan.kernels.plan.cpu_pass import decide, frontiers, linearize
from rheoplan.kernels.slot_expansion.cpu_pass import expand_assign
from rheoplan.pipeline import DraftFn, PassContext
from rheoplan.planner.assign import gumbel_sampler
from rheoplan.planner.cost_depth import another_depth_pays
from rheoplan.planner.cost_prune import CostDecision, LastDecision, cost_prune_tree
from rheoplan.rng import Streams


def plan_cost_tree(draft: DraftFn, root_tokens: Sequence[int], *, tree: TreeConfig, sampling: SamplingConfig,
                   plan: CostPlan, prefix_len: Sequence[int], seed: int, step: int | Sequence[int],
                   stream_keys: Sequence[int] | None = None,
                   on_decision: Callable[[CostDecision], None] | None = None,
                   arena: HostTreeArena | None = None) -> DraftTree:
    """The linearised tree ``plan_tree(draft, root_tokens, passes=cost_pipeline(plan,
    lower(DEFAULT_PIPELINE, 'numba'), on_decision, decide, frontiers), backend='numba',
    ...)`` gives (the numba ``decide`` and ``frontiers`` of ``kernels/plan/cpu_pass``),
    with no instrument: the same passes in the same order, each writing the tree it is
    given. ``draft``, ``tree``, ``sampling``, ``prefix_len``, ``seed``, ``step`` and
    ``stream_keys`` are ``plan_tree``'s; ``on_decision`` observes the prune's decision as
    ``cost_prune``'s does. ``arena``: build the tree over these tables (``ir.HostTreeArena``:
    the tree of the previous call with this arena is overwritten), else fresh ones."""
    roots = torch.as_tensor(root_tokens, dtype=torch.int64).reshape(-1)
    B = roots.numel()
    if B == 0:
        raise ValueError("root_tokens is empty: need one root token per tree")
    if not isinstance(step, int):
        step = tuple(int(x) for x in step)
        if len(step) != B:
            raise ValueError(f"step has {len(step)} entries for {B} trees: allowed an int or one per tree")
    if stream_keys is not None:
        stream_keys = [int(k) for k in stream_keys]
        if len(stream_keys) != B:
            raise ValueError(f"stream_keys has {len(stream_keys)} ids for {B} trees: allowed one id per tree")
    prefix = torch.as_tensor(prefix_len, dtype=torch.int64).reshape(-1).expand(B)
    # the run owns its tree: the kernels write its tables through views made with it
    t, views = (empty_host_tree if arena is None else arena.tree)(
        B, tree.capacity, tree.max_expanded, tree.support, roots, prefix, tree.effective_rheostat(sampling), tree.slots)
    ctx = PassContext(tree_cfg=tree, sampling=sampling, draft=draft,
                      sampler=gumbel_sampler(Streams(seed), step, stream_keys),
                      step=step if isinstance(step, int) else max(step), in_place=True)
    decisions = LastDecision(partial(decide, views=views))  # the prune reuses the decision behind a declined depth
    frontiers_fn = partial(frontiers, views=views)
    for _ in range(tree.depth):
        # cost_expand: a declined depth ends the growth (the pipeline's later passes would
        # get that very tree back and decide the same: run_pipeline's fixpoint)
        if not another_depth_pays(plan, t, tree.frontier, tree.budget, decisions, frontiers_fn):
            break
        t = expand_assign(t, ctx, views)  # assign(expand(t, ctx), ctx) in one call
    return linearize(cost_prune_tree(t, ctx, plan, on_decision, decisions, views), ctx, views)
