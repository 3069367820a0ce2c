"""The default pipeline end to end: global properties of planned trees, equality with
an independent naive EAGLE-2 top-K construction when there is no sampled slot, and
the rank invariance of the sampled node under the Y-independent proxies."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from _planner_helpers import NodeIdDraft, PathDraft, ancestors, logit_rows, planning_problems, rank_key, shape_of
from rheoplan import SamplingConfig, TreeConfig, plan_tree
from rheoplan.ir import NodeKind
from rheoplan.planner.default import DEFAULT_PIPELINE
from rheoplan.planner.lint import lint

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def test_default_pipeline_reads_expand_assign_then_prune_linearize():
    from rheoplan.pipeline import PassContext, flatten

    ctx = PassContext(tree_cfg=TreeConfig(depth=3), sampling=SamplingConfig())
    names = [n for n, _ in flatten(DEFAULT_PIPELINE, ctx)]
    assert names == ["expand@1", "assign@1", "expand@2", "assign@2", "expand@3", "assign@3",
                     "prune", "linearize"]


@SETTINGS
@given(planning_problems())
def test_planned_trees_have_the_global_properties(problem):
    draft, cfg, sampling, roots, seed = problem
    t = plan_tree(draft, roots, tree=cfg, sampling=sampling, seed=seed)
    assert lint(t) == []
    for b in range(t.batch):
        n = int(t.n_nodes[b])
        assert n <= cfg.capacity
        kept = [v for v in range(n) if t.kept[b, v]]
        # budget: the best min(N, created) drafted nodes by the written-out ranking key
        best = sorted(range(1, n), key=lambda v: rank_key(t, b, v))[: cfg.budget]
        assert sorted(best) == kept[1:]
        for v in kept:  # closed under ancestors
            assert all(t.kept[b, a] for a in ancestors(t, b, v))
        for v in range(1, n):
            p = int(t.parent[b, v])
            assert t.depth[b, v] == t.depth[b, p] + 1
            assert t.score[b, v] <= t.score[b, p]  # scores never increase along a path
            assert t.token[b, v] >= 0
        # frontier: at each depth d >= 1 the expanded nodes are the k best of that depth
        for d in range(1, int(t.cur_depth)):
            level = [v for v in range(n) if t.depth[b, v] == d]
            want = sorted(level, key=lambda v: rank_key(t, b, v))[: cfg.frontier]
            assert sorted(want) == [v for v in level if t.expanded[b, v]]
        assert not any(t.expanded[b, v] for v in range(n) if t.depth[b, v] == cfg.depth)


# -- EAGLE-2 reference -----------------------------------------------------------------------


def f32_log(x: float) -> float:
    return float(torch.log(torch.tensor(x, dtype=torch.float32)))


def f32(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float32))


def naive_eagle(draft: PathDraft, root: int, D: int, k: int, K: int, N: int, temperature: float):
    """EAGLE-2's dynamic tree written from the EAGLE-2 paper's description, independently of planner/:
    explicit candidate lists, cumulative float32 log-probabilities, ties broken by
    (higher score, shallower, created earlier); every level's top-k expands K children."""
    nodes = [{"parent": -1, "depth": 0, "token": root, "score": 0.0, "path": (root,)}]

    def children(v: int):
        node = nodes[v]
        logits = draft.logits_for_path(node["path"])
        q = torch.softmax(logits.to(torch.float32) / (temperature or 1.0), dim=-1).tolist()
        ranked = sorted(range(len(q)), key=lambda tok: (-q[tok], tok))[:K]
        for tok in ranked:
            nodes.append({"parent": v, "depth": node["depth"] + 1, "token": tok,
                          "score": f32(node["score"] + f32_log(q[tok])), "path": node["path"] + (tok,)})

    key = lambda v: (-nodes[v]["score"], nodes[v]["depth"], v)  # noqa: E731
    children(0)
    for d in range(1, D):
        candidates = [v for v in range(len(nodes)) if nodes[v]["depth"] == d]
        for v in sorted(candidates, key=key)[:k]:
            children(v)
    kept = sorted(sorted(range(1, len(nodes)), key=key)[:N])
    return nodes, [0] + kept


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_no_sampled_slot_is_eagle2_top_k(data):
    """m = K, or T = 0, gives exactly EAGLE-2's top-K dynamic tree (same nodes in the same
    creation order, same kept set, same linear order)."""
    V = data.draw(st.integers(2, 8))
    K = data.draw(st.integers(1, V))
    greedy = data.draw(st.booleans())
    temperature = 0.0 if greedy else data.draw(st.sampled_from([0.5, 1.0, 1.7]))
    cfg = TreeConfig(depth=data.draw(st.integers(1, 4)), frontier=data.draw(st.integers(1, 4)), slots=K,
                     budget=data.draw(st.integers(1, 30)),
                     rheostat=data.draw(st.integers(0, K)) if greedy else K, support=data.draw(st.integers(K, V)))
    draft = PathDraft(data.draw(logit_rows(V, data.draw(st.integers(1, 5)))))
    root = data.draw(st.integers(0, V - 1))
    t = plan_tree(draft, [root], tree=cfg, sampling=SamplingConfig(temperature=temperature))
    nodes, kept = naive_eagle(draft, root, cfg.depth, cfg.frontier, K, cfg.budget, temperature)
    n = int(t.n_nodes[0])
    assert n == len(nodes)
    assert t.parent[0, :n].tolist() == [x["parent"] for x in nodes]
    assert t.token[0, :n].tolist() == [x["token"] for x in nodes]
    assert t.score[0, :n].tolist() == [x["score"] for x in nodes]
    assert set(t.kind[0, 1:n].tolist()) <= {int(NodeKind.DET)}
    assert t.linear.node[0, : int(t.linear.n[0])].tolist() == kept


# -- rank invariance ---------------------------------------------------------------------------


def plans_for_every_draw(draft, cfg: TreeConfig, node: int, root: int = 0):
    """Plan once per possible tail index at ``node`` (every other draw fixed to index 0)."""
    sampling = SamplingConfig(temperature=1.0)
    probe = plan_tree(draft, [root], tree=cfg, sampling=sampling, sampler=lambda b, v, qt: 0)
    row = int(probe.exp_row[0, node])
    assert row >= 0, "the probed node must be expanded"
    tail = int(probe.sup_n[0, row]) - cfg.rheostat
    out = []
    for i in range(tail):
        sampler = lambda b, v, qt, i=i: i if v == node else 0  # noqa: E731
        out.append(plan_tree(draft, [root], tree=cfg, sampling=sampling, sampler=sampler))
    return out, row


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_sampled_rank_is_independent_of_y_under_default_and_next_rank(data):
    V = data.draw(st.integers(3, 7))
    K = data.draw(st.integers(2, min(V, 4)))
    m = data.draw(st.integers(0, K - 1))
    cfg = TreeConfig(depth=data.draw(st.integers(2, 3)), frontier=data.draw(st.integers(1, 3)), slots=K,
                     budget=data.draw(st.integers(1, 14)), rheostat=m, support=data.draw(st.integers(K, V)),
                     proxy=data.draw(st.sampled_from(["default", "next_rank"])))
    draft = NodeIdDraft(data.draw(logit_rows(V, 5)))
    node = data.draw(st.sampled_from([0, 1]))
    probe = plan_tree(draft, [0], tree=cfg, sampling=SamplingConfig(), sampler=lambda b, v, qt: 0)
    if not probe.expanded[0, node]:
        node = 0
    trees, row = plans_for_every_draw(draft, cfg, node)
    c = int(trees[0].y_node[0, row])
    # the sampled child's score, and so its kept / expanded status, never depends on Y
    assert len({float(t.score[0, c]) for t in trees}) == 1
    assert len({(bool(t.kept[0, c]), bool(t.expanded[0, c])) for t in trees}) == 1
    if K == m + 1:
        # no PAD siblings (whose q, and so their scores, do follow Y): the whole shape is fixed
        shapes = [shape_of(t) for t in trees]
        assert all(s == shapes[0] for s in shapes)


def test_true_q_proxy_changes_the_shape_with_y():
    """Concrete counter-example: with the ablation proxy pi = q(Y), a likely Y keeps the
    sampled node and an unlikely one prunes it (same draft, same config). q = [.5, .3, .15, .05]
    everywhere, m = 1, K = 2, budget 2: the DET grandchild scores log .25, so the sampled
    child is kept only when q(Y) = .3 beats it."""
    draft = NodeIdDraft([torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05])).tolist()])
    cfg = TreeConfig(depth=2, frontier=1, slots=2, budget=2, rheostat=1, support=4, proxy="true_q")
    trees, row = plans_for_every_draw(draft, cfg, node=0)
    c = int(trees[0].y_node[0, row])
    assert [bool(t.kept[0, c]) for t in trees] == [True, False, False]
    assert shape_of(trees[0]) != shape_of(trees[2])
    # the default proxy on the very same problem: one shape for every draw
    trees, _ = plans_for_every_draw(draft, cfg.with_(proxy="default"), node=0)
    assert all(shape_of(t) == shape_of(trees[0]) for t in trees)


@pytest.mark.parametrize("proxy", ["default", "next_rank", "true_q"])
def test_same_seed_same_tree(proxy):
    draft = PathDraft([[0.5, 0.1, 1.0, -0.3, 0.0, 0.7], [1.0, 1.0, 0.0, 0.0, -1.0, 2.0]])
    cfg = TreeConfig(depth=3, frontier=2, slots=3, budget=8, support=6, proxy=proxy)
    a = plan_tree(draft, [1, 2], tree=cfg, sampling=SamplingConfig(), seed=3)
    b = plan_tree(draft, [1, 2], tree=cfg, sampling=SamplingConfig(), seed=3)
    assert torch.equal(a.token, b.token) and torch.equal(a.kept, b.kept)


def test_pad_siblings_follow_y_so_full_shape_needs_no_pad():
    """Documents the limit of rank invariance: PAD children take the best tail tokens
    other than Y and are scored by their own q, so with PAD slots their scores (and what
    they displace) depend on Y. Only the sampled node's own rank is Y-independent.
    q = [.45, .35, .1, .1], m = 1, K = 3, budget 3: the grandchild scores log .2025;
    Y = r2 leaves PAD = r3 (.1, pruned), Y = r3 gives PAD = r2 (.35, kept)."""
    draft = NodeIdDraft([torch.log(torch.tensor([0.45, 0.35, 0.1, 0.1])).tolist()])
    cfg = TreeConfig(depth=2, frontier=1, slots=3, budget=3, rheostat=1, support=4)
    trees, row = plans_for_every_draw(draft, cfg, node=0)
    c = int(trees[0].y_node[0, row])
    assert all(bool(t.kept[0, c]) for t in trees)  # the sampled node: always kept
    assert shape_of(trees[0]) != shape_of(trees[1])  # its PAD sibling: kept for one Y only
