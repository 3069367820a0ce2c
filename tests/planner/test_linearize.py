"""Pass ``linearize``: order, positions, parents, ancestor masks and their bit-words."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from _planner_helpers import PathDraft, ancestors, planning_problems
from rheoplan import SamplingConfig, TreeConfig, plan_tree
from rheoplan.planner.linearize import pack_bits, unpack_bits


def test_pack_bits_examples():
    assert pack_bits(torch.tensor([True, False, True])).tolist() == [5]
    top = torch.zeros(64, dtype=torch.bool)
    top[63] = True
    assert pack_bits(top).tolist() == [-(2**63)]  # bit 63 is the sign bit
    two_words = torch.zeros(65, dtype=torch.bool)
    two_words[64] = True
    assert pack_bits(two_words).tolist() == [0, 1]


@given(st.lists(st.booleans(), min_size=1, max_size=200))
@settings(max_examples=100, deadline=None)
def test_unpack_inverts_pack(bits):
    mask = torch.tensor(bits)
    words = pack_bits(mask)
    assert words.shape[-1] == (len(bits) + 63) // 64
    assert torch.equal(unpack_bits(words, len(bits)), mask)
    for j, x in enumerate(bits):  # the documented layout, bit by bit
        assert bool((int(words[j // 64]) >> (j % 64)) & 1) == x


def check_linear(t, cfg: TreeConfig):
    lin = t.linear
    L = 1 + cfg.budget
    assert lin.node.shape == (t.batch, L) and lin.ancestor_bits.shape[-1] == (L + 63) // 64
    assert torch.equal(unpack_bits(lin.ancestor_bits, L), lin.ancestor_mask)
    for b in range(t.batch):
        n = int(lin.n[b])
        kept = [v for v in range(int(t.n_nodes[b])) if t.kept[b, v]]
        assert lin.node[b, :n].tolist() == kept  # depth-major BFS = ascending ids
        lin_of = {v: i for i, v in enumerate(kept)}
        for i, v in enumerate(kept):
            p = int(t.parent[b, v])
            assert int(lin.parent[b, i]) == (lin_of[p] if p >= 0 else -1)
            assert int(lin.parent[b, i]) < i  # parents before children
            assert int(lin.depth[b, i]) == int(t.depth[b, v])
            assert int(lin.position[b, i]) == int(t.prefix_len[b]) + int(t.depth[b, v])
            assert int(lin.token[b, i]) == int(t.token[b, v])
            assert int(lin.exp_row[b, i]) == int(t.exp_row[b, v])
            brute = {lin_of[a] for a in ancestors(t, b, v)}
            assert set(torch.nonzero(lin.ancestor_mask[b, i]).flatten().tolist()) == brute
            kids = [j for j in range(n) if int(lin.parent[b, j]) == i]
            assert int(lin.n_children[b, i]) == len(kids)
            assert int(lin.first_child[b, i]) == (kids[0] if kids else -1)
            assert kids == list(range(kids[0], kids[0] + len(kids))) if kids else True  # contiguous
        assert not lin.ancestor_mask[b, n:].any() and (lin.node[b, n:] == -1).all()
        leaves = [i for i in range(n) if int(lin.n_children[b, i]) == 0]
        paths = [[x for x in lin.paths[b, j].tolist() if x >= 0] for j in range(int(lin.n_paths[b]))]
        assert [p[-1] for p in paths] == leaves
        for p in paths:
            assert p[0] == 0 and all(int(lin.parent[b, c]) == a for a, c in zip(p, p[1:]))


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(planning_problems())
def test_linear_tree_matches_brute_force(problem):
    draft, cfg, sampling, roots, seed = problem
    t = plan_tree(draft, roots, tree=cfg, sampling=sampling, seed=seed, prefix_len=[7] * len(roots))
    check_linear(t, cfg)


def test_more_than_64_linear_slots_use_two_words():
    cfg = TreeConfig(depth=4, frontier=4, slots=5, budget=70, rheostat=1, support=8)
    draft = PathDraft([[0.1 * i for i in range(8)], [1.0, 0.0, 2.0, 0.5, 0.5, 0.0, -1.0, 3.0]])
    t = plan_tree(draft, [3, 4], tree=cfg, sampling=SamplingConfig(), prefix_len=[2, 9])
    assert int(t.linear.n.max()) > 64
    check_linear(t, cfg)
