"""``lint``: a well-formed tree passes; each broken invariant is reported by name."""

from __future__ import annotations

import pytest
import torch

from _planner_helpers import PathDraft
from rheoplan import SamplingConfig, TreeConfig, plan_tree
from rheoplan.ir import NodeKind
from rheoplan.planner.lint import lint

CFG = TreeConfig(depth=3, frontier=2, slots=3, budget=6, rheostat=1, support=6)
DRAFT = PathDraft([[0.5, 0.1, 1.0, -0.3, 0.0, 0.7], [1.0, 1.0, 0.0, 0.0, -1.0, 2.0]])


@pytest.fixture
def good():
    return plan_tree(DRAFT, [1], tree=CFG, sampling=SamplingConfig(), seed=5)


def test_a_planned_tree_is_well_formed(good):
    assert lint(good) == []


def first_unkept(t):
    return next(v for v in range(int(t.n_nodes[0])) if not t.kept[0, v] and t.expanded[0, int(t.parent[0, v])])


def break_kept_closure(t):
    t.kept[0, :] = False
    t.kept[0, 0] = True
    t.kept[0, int(t.n_nodes[0]) - 1] = True


def break_score(t):
    t.score[0, 1] = 1.0


def break_duplicate_token(t):
    t.token[0, 2] = t.token[0, 1]


def break_kinds(t):
    t.kind[0, 1] = int(NodeKind.PAD)


def break_sampled_in_top_m(t):
    t.y_token[0, 0] = t.sup_token[0, 0, 0]


def break_root(t):
    t.kept[0, 0] = False


def break_depth(t):
    t.depth[0, 2] = 5


def break_tail_garbage(t):
    t.n_nodes[0] -= 1  # the last created node now lies past n_nodes


def break_exp_row(t):
    t.exp_row[0, 0] = 3


@pytest.mark.parametrize("breaker, message", [
    (break_kept_closure, "ancestor-closed"),
    (break_score, "above its parent"),
    (break_duplicate_token, "duplicate child tokens"),
    (break_kinds, "child kinds"),
    (break_sampled_in_top_m, "among the top-1 ranks"),
    (break_root, "root is not kept"),
    (break_depth, "depth"),
    (break_tail_garbage, "past n_nodes"),
    (break_exp_row, "points to row"),
])
def test_lint_reports_each_broken_invariant(good, breaker, message):
    bad = good.clone()
    breaker(bad)
    problems = lint(bad)
    assert any(message in p for p in problems), problems
    assert all(p.startswith("tree 0: ") for p in problems)


def test_lint_checks_the_linear_tree(good):
    lin = good.linear
    broken = good.replace(linear=lin.__class__(**{**lin.__dict__, "parent": torch.flip(lin.parent, [1])}))
    assert any("not before it" in p for p in lint(broken))
