"""The IR: empty trees, clone, helpers and the ranking order."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from _planner_helpers import PathDraft, assert_trees_equal
from rheoplan import SamplingConfig, TreeConfig, plan_tree
from rheoplan.ir import HostTreeArena, NodeKind, empty_host_tree, empty_tree, host_table, rank_key_order


def test_empty_tree_holds_only_a_kept_root():
    t = empty_tree(2, 7, 3, 4, torch.tensor([5, 6]), torch.tensor([10, 20]), rheostat=1, slots=2)
    assert t.batch == 2 and t.capacity == 7 and t.cur_depth == 0
    assert t.token[:, 0].tolist() == [5, 6] and t.prefix_len.tolist() == [10, 20]
    assert t.kind[:, 0].tolist() == [int(NodeKind.ROOT)] * 2 and t.kept[:, 0].all()
    assert (t.kind[:, 1:] == -1).all() and (t.parent == -1).all() and t.linear is None


@pytest.mark.parametrize("B,M,E,S,m,K", [(1, 49, 16, 128, 1, 3), (3, 10, 4, 8, 2, 2), (2, 1, 1, 1, 1, 1)])
def test_empty_host_tree_is_empty_tree_with_views_of_its_tables(B, M, E, S, m, K):
    """The same tables as ``empty_tree``; each view is its tensor's memory (a write through
    it shows in the tree); two trees share nothing."""
    roots, prefix = torch.arange(5, 5 + B), torch.tensor([7]).expand(B)
    t, views = empty_host_tree(B, M, E, S, roots, prefix, m, K)
    assert_trees_equal(empty_tree(B, M, E, S, roots, prefix, m, K), t)
    tensors = {k: v for k, v in t.__dict__.items() if isinstance(v, torch.Tensor)}
    assert set(views) == set(tensors)
    for name, a in views.items():
        assert a.shape == tuple(tensors[name].shape) and host_table(t, name, views) is a
        assert a.__array_interface__["data"][0] == tensors[name].data_ptr(), name
    views["score"][0, 0] = 3.5
    views["n_nodes"][-1] = 9
    assert t.score[0, 0] == 3.5 and t.n_nodes[-1] == 9
    t2, views2 = empty_host_tree(B, M, E, S, roots, prefix, m, K)
    assert t2.score[0, 0] == 0 and t2.n_nodes[-1] == 1 and views2["score"] is not views["score"]
    assert_trees_equal(empty_tree(B, M, E, S, roots, prefix, m, K), t2)


def test_an_arena_hands_out_empty_trees_over_the_same_tables():
    """Each call: a new tree object equal to ``empty_tree`` whatever was written into the
    last one, over the same tables (the last tree is overwritten); another shape gets
    its own tables."""
    arena = HostTreeArena()
    shape = (1, 49, 16, 128, 1, 3)
    seen = []
    for call in range(3):
        roots, prefix = torch.tensor([call + 5]), torch.tensor([call + 10])
        t, views = arena.tree(*shape[:4], roots, prefix, *shape[4:])
        assert_trees_equal(empty_tree(*shape[:4], roots, prefix, *shape[4:]), t)
        assert all(host_table(t, n, views).__array_interface__["data"][0] == getattr(t, n).data_ptr()
                   for n in views)
        seen.append((t, t.score.data_ptr()))
        for a in views.values():  # a plan writes its tables
            a[...] = 1
    assert len({id(t) for t, _ in seen}) == 3 and len({p for _, p in seen}) == 1
    assert int(seen[0][0].prefix_len[0]) == 1  # the first tree's tables were overwritten
    small, _ = arena.tree(2, 5, 2, 4, torch.tensor([1, 2]), torch.tensor([3, 4]), 1, 2)
    assert_trees_equal(empty_tree(2, 5, 2, 4, torch.tensor([1, 2]), torch.tensor([3, 4]), 1, 2), small)
    again, _ = arena.tree(*shape[:4], torch.tensor([1]), torch.tensor([2]), *shape[4:])
    assert_trees_equal(empty_tree(*shape[:4], torch.tensor([1]), torch.tensor([2]), *shape[4:]), again)


def test_rank_key_order_docstring_example():
    order = rank_key_order(torch.tensor([-1.0, -0.5, -1.0]), torch.tensor([4, 5, 6]))
    assert order.tolist() == [1, 0, 2]


@given(st.lists(st.sampled_from([0.0, -1.0, -2.5, float("-inf")]), min_size=1, max_size=30))
@settings(max_examples=100)
def test_rank_key_order_is_score_desc_then_id(scores):
    ids = torch.randperm(len(scores), generator=torch.Generator().manual_seed(len(scores)))
    order = rank_key_order(torch.tensor(scores), ids)
    want = sorted(range(len(scores)), key=lambda i: (-scores[i], int(ids[i])))
    assert order.tolist() == want


def test_clone_is_deep_and_helpers_read_the_tree():
    cfg = TreeConfig(depth=2, frontier=1, slots=2, budget=3, rheostat=1, support=3)
    t = plan_tree(PathDraft([[2.0, 1.0, 0.0]]), [1], tree=cfg, sampling=SamplingConfig(), seed=2)
    c = t.clone()
    c.token[0, 1] = 99
    assert int(t.token[0, 1]) != 99
    assert t.children(0, 0) == [1, 2]
    v = t.children(0, 1)[0]
    assert t.path_tokens(0, v) == [int(t.token[0, 1]), int(t.token[0, v])]
    assert t.path_tokens(0, 0) == []


def test_capacity_bounds_hold():
    cfg = TreeConfig(depth=3, frontier=2, slots=3, budget=30, rheostat=1, support=4)
    t = plan_tree(PathDraft([[0.0, 1.0, 2.0, 3.0]]), [0], tree=cfg, sampling=SamplingConfig())
    assert int(t.n_nodes[0]) == cfg.capacity == 1 + 3 * (1 + 2 * 2)
    assert int(t.n_expanded[0]) == cfg.max_expanded


def test_replace_shares_the_other_fields_and_refuses_unknown_names():
    """``DraftTree.replace`` (every pass returns through it): the changed fields are new,
    every other one is the same object, the original is untouched, and a name that is not
    a field is refused with the allowed names, as ``dataclasses.replace`` refuses it."""
    import dataclasses

    t = empty_tree(2, 8, 4, 4, torch.tensor([5, 6]), torch.tensor([3, 4]), 1, 3)
    kept = torch.ones_like(t.kept)
    u = t.replace(kept=kept, cur_depth=2)
    assert u is not t and u.kept is kept and u.cur_depth == 2
    assert t.cur_depth == 0 and not bool(t.kept[:, 1:].any())
    for f in dataclasses.fields(t):
        if f.name not in ("kept", "cur_depth"):
            assert getattr(u, f.name) is getattr(t, f.name), f.name
    assert u == dataclasses.replace(t, kept=kept, cur_depth=2)
    with pytest.raises(TypeError, match=r"no field\(s\) \['bogus'\].*allowed"):
        t.replace(bogus=1)


def test_to_the_device_a_tree_is_on_returns_it():
    """``DraftTree.to`` of a tree already there (the CPU walk asks every step) is the tree
    itself, its linear form included; asking for another device still copies."""
    t = plan_tree(PathDraft([[0.5, 0.1, 1.0, -0.3, 0.0]]), [1], tree=TreeConfig(depth=2, frontier=2, slots=3, budget=4,
                                                                                   rheostat=1, support=5),
                  sampling=SamplingConfig())
    assert t.linear is not None and t.to("cpu") is t and t.to(torch.device("cpu")) is t
    moved = t.to("meta")
    assert moved is not t and moved.parent.device.type == "meta" and moved.linear.token.device.type == "meta"
    assert moved.to("meta") is moved
    for name in ("q", "linear"):  # one table elsewhere (the tree's or its linear form's): not there yet
        mixed = t.replace(**{name: getattr(moved, name)})
        with pytest.raises(NotImplementedError):  # (a meta tensor has no data to copy back)
            mixed.to("cpu")
