"""Pass ``prune``: keep the budget best nodes; ties go to shallower, then earlier nodes."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings

from _planner_helpers import ancestors, planning_problems, rank_key
from rheoplan import SamplingConfig, TreeConfig, plan_tree
from rheoplan.ir_text import from_text, to_text
from rheoplan.pipeline import PassContext
from rheoplan.planner.prune import prune

# Before: a root with two children and two grandchildren under %1, written in the text IR.
# %2 and %3 tie at -1 (the shallower %2 wins); %3 and %4 tie at -1.5... see the cases.
BEFORE = """\
draft_tree B=1 capacity=5 max_expanded=2 support=2 cur_depth=2 rheostat=2 slots=2
tree 0 prefix_len=3 n_nodes=5 n_expanded=2
  %0 = ROOT depth=0 token=9 q=1 w=1 score=0 kept expanded row=0
  %1 = DET parent=%0 depth=1 slot=0 token=1 q=0.5 w=0.5 score=-0.5 expanded row=1
  %2 = DET parent=%0 depth=1 slot=1 token=2 q=0.5 w=0.5 score=-1
  %3 = DET parent=%1 depth=2 slot=0 token=3 q=0.5 w=0.5 score=-1
  %4 = DET parent=%1 depth=2 slot=1 token=4 q=0.5 w=0.5 score=-1
  row 0 node=%0 n=2 z=0 Y=? q~(Y)=0 y_node=-
    support 1:0.5 2:0.5
  row 1 node=%1 n=2 z=0 Y=? q~(Y)=0 y_node=-
    support 3:0.5 4:0.5
"""


def kept_after(budget: int) -> list[int]:
    ctx = PassContext(tree_cfg=TreeConfig(depth=2, frontier=1, slots=2, budget=budget, rheostat=2, support=2),
                      sampling=SamplingConfig())
    t = prune(from_text(BEFORE), ctx)
    return [v for v in range(5) if t.kept[0, v]]


def test_prune_before_after_with_ties():
    assert kept_after(1) == [0, 1]
    assert kept_after(2) == [0, 1, 2]  # -1 tie: the shallower %2 first
    assert kept_after(3) == [0, 1, 2, 3]  # -1 tie at depth 2: created earlier first
    assert kept_after(10) == [0, 1, 2, 3, 4]


def test_prune_does_not_mutate_its_input():
    t = from_text(BEFORE)
    text = to_text(t)
    kept_after(1)
    ctx = PassContext(tree_cfg=TreeConfig(depth=2, frontier=1, slots=2, budget=1, rheostat=2, support=2),
                      sampling=SamplingConfig())
    prune(t, ctx)
    assert to_text(t) == text


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(planning_problems(max_depth=3))
def test_kept_set_is_top_n_and_ancestor_closed(problem):
    draft, cfg, sampling, roots, seed = problem
    t = plan_tree(draft, roots, tree=cfg, sampling=sampling, seed=seed)
    ctx = PassContext(tree_cfg=cfg, sampling=sampling)
    again = prune(t, ctx)
    assert torch.equal(again.kept, t.kept)  # idempotent
    for b in range(t.batch):
        n = int(t.n_nodes[b])
        want = sorted(sorted(range(1, n), key=lambda v: rank_key(t, b, v))[: cfg.budget])
        assert [v for v in range(1, n) if t.kept[b, v]] == want
        assert int(t.kept[b].sum()) == 1 + min(cfg.budget, n - 1)
        assert all(t.kept[b, a] for v in want for a in ancestors(t, b, v))
        # the realised Y survives pruning of the sampled child (phantom)
        for r in range(int(t.n_expanded[b])):
            if t.rheostat < t.slots:
                assert int(t.y_token[b, r]) >= 0
