"""Pass ``expand``: frontier choice, slot layout, proxies, errors."""

from __future__ import annotations

import math
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from _planner_helpers import PathDraft
from rheoplan import SamplingConfig, TreeConfig
from rheoplan.ir_text import to_text
from rheoplan.ir import NodeKind, empty_tree
from rheoplan.pipeline import PassContext
from rheoplan.planner.expand import expand, log_weight, proxy_weight, select_frontier

Q = [0.4, 0.3, 0.2, 0.1]  # draft law used by the fixed-draft tests
LOGQ = torch.log(torch.tensor(Q)).tolist()


def fixed_draft(tree, nodes):
    return torch.tensor(LOGQ).expand(nodes.shape[0], nodes.shape[1], 4).clone()


def root_tree(cfg: TreeConfig, sampling=SamplingConfig(), root=2):
    return empty_tree(1, cfg.capacity, cfg.max_expanded, cfg.support, torch.tensor([root]),
                      torch.tensor([5]), cfg.effective_rheostat(sampling), cfg.slots)


def strip_floats(text: str) -> str:
    return re.sub(r" (q|w|score|z|q~\(Y\))=\S+", "", text)


def test_expand_root_before_after():
    cfg = TreeConfig(depth=2, frontier=1, slots=3, budget=3, rheostat=1, support=4)
    before = root_tree(cfg)
    ctx = PassContext(tree_cfg=cfg, sampling=SamplingConfig(), draft=fixed_draft)
    after = expand(before, ctx)
    assert strip_floats(to_text(after)).splitlines()[1:7] == [
        "tree 0 prefix_len=5 n_nodes=4 n_expanded=1",
        "  %0 = ROOT depth=0 token=2 kept expanded row=0",
        "  %1 = DET parent=%0 depth=1 slot=0 token=0",
        "  %2 = SAMPLED parent=%0 depth=1 slot=1 token=?",  # drawn by assign
        "  %3 = PAD parent=%0 depth=1 slot=2 token=?",  # filled by assign (skips Y)
        "  row 0 node=%0 n=4 Y=? y_node=%2",
    ]
    q = after.sup_q[0, 0].tolist()
    assert after.sup_token[0, 0].tolist() == [0, 1, 2, 3]
    assert float(after.z[0, 0]) == pytest.approx(sum(q[1:]))
    assert float(after.weight[0, 2]) == pytest.approx(min(q[0], sum(q[1:])))  # default proxy
    assert float(after.score[0, 2]) == pytest.approx(math.log(min(q[0], sum(q[1:]))))
    assert math.isnan(float(after.score[0, 3]))  # PAD score pending
    assert to_text(before) == to_text(root_tree(cfg)), "expand mutated its input"


def test_frontier_is_k_best_of_deepest_level_with_ties_to_lower_id():
    cfg = TreeConfig(depth=3, frontier=2, slots=4, budget=3, rheostat=4, support=4)
    uniform = lambda t, nodes: torch.zeros(nodes.shape[0], nodes.shape[1], 4)  # noqa: E731
    ctx = PassContext(tree_cfg=cfg, sampling=SamplingConfig(), draft=uniform)
    t = expand(root_tree(cfg), ctx)
    assert select_frontier(t, 0, 2) == [1, 2]  # four equal scores: created first wins
    t2 = expand(t, ctx)
    assert t2.exp_node[0, 1:3].tolist() == [1, 2]
    assert t2.parent[0, 5:13].tolist() == [1] * 4 + [2] * 4


@given(st.lists(st.floats(0, 1, width=32), min_size=2, max_size=8), st.data())
@settings(max_examples=100, deadline=None)
def test_proxies_bound_every_possible_pad_sibling(raw, data):
    q = torch.tensor(sorted(raw, reverse=True), dtype=torch.float32)
    if float(q.sum()) == 0:
        q[0] = 1.0
    q = torch.sort(q / q.sum(), descending=True).values
    n = q.numel()
    m = data.draw(st.integers(0, n - 1))
    for policy in ("default", "next_rank"):
        pi = proxy_weight(policy, q, m, n)
        assert 0.0 <= pi <= 1.0 + 1e-6
        # any tail token can be a PAD sibling: pi must bound them all (so the sampled
        # node outranks its PAD siblings whatever Y is)
        assert all(log_weight(pi) >= log_weight(float(x)) for x in q[m:])
    assert proxy_weight("true_q", q, m, n) is None


def test_proxy_examples_from_the_spec():
    q = torch.tensor([0.5, 0.3, 0.2])
    assert proxy_weight("default", q, 1, 3) == pytest.approx(0.5)
    assert proxy_weight("default", q, 2, 3) == pytest.approx(0.2)  # min(q(r_2), z = 0.2)
    assert proxy_weight("default", q, 0, 3) == pytest.approx(0.5)  # m = 0: q(r_1)
    assert proxy_weight("next_rank", q, 1, 3) == pytest.approx(0.3)
    with pytest.raises(ValueError, match="proxy"):
        proxy_weight("bogus", q, 1, 3)


def test_greedy_has_no_sampled_slot():
    cfg = TreeConfig(depth=1, frontier=1, slots=3, budget=3, rheostat=1, support=4)
    s = SamplingConfig(temperature=0)
    t = expand(root_tree(cfg, s), PassContext(tree_cfg=cfg, sampling=s, draft=fixed_draft))
    assert t.kind[0, 1:4].tolist() == [int(NodeKind.DET)] * 3
    assert t.token[0, 1:4].tolist() == [0, 1, 2]


def test_zero_probability_tokens_get_minus_inf_scores():
    cfg = TreeConfig(depth=1, frontier=1, slots=3, budget=3, rheostat=3, support=3)
    draft = PathDraft([[0.0, float("-inf"), float("-inf")]])
    t = expand(root_tree(cfg, root=0), PassContext(tree_cfg=cfg, sampling=SamplingConfig(), draft=draft))
    assert t.score[0, 1:4].tolist() == [0.0, float("-inf"), float("-inf")]
    assert t.token[0, 1:4].tolist() == [0, 1, 2]  # zero-q ties by lower id


def test_expand_errors_name_the_problem():
    cfg = TreeConfig(depth=1, frontier=1, slots=3, budget=3, rheostat=1, support=4)
    with pytest.raises(ValueError, match="ctx.draft"):
        expand(root_tree(cfg), PassContext(tree_cfg=cfg, sampling=SamplingConfig()))
    bad_shape = lambda t, nodes: torch.zeros(2, 1, 4)  # noqa: E731
    with pytest.raises(ValueError, match="expected"):
        expand(root_tree(cfg), PassContext(tree_cfg=cfg, sampling=SamplingConfig(), draft=bad_shape))
    tiny_vocab = lambda t, nodes: torch.zeros(1, 1, 2)  # noqa: E731
    with pytest.raises(ValueError, match="slots=3 exceeds"):
        expand(root_tree(cfg), PassContext(tree_cfg=cfg, sampling=SamplingConfig(), draft=tiny_vocab))
    once = expand(root_tree(cfg), PassContext(tree_cfg=cfg, sampling=SamplingConfig(), draft=fixed_draft))
    with pytest.raises(ValueError, match="depth"):
        expand(once, PassContext(tree_cfg=cfg, sampling=SamplingConfig(), draft=fixed_draft))
    nan_draft = lambda t, nodes: torch.full((1, 1, 4), float("nan"))  # noqa: E731
    with pytest.raises(ValueError, match="NaN"):
        expand(root_tree(cfg), PassContext(tree_cfg=cfg, sampling=SamplingConfig(), draft=nan_draft))


@given(st.integers(5, 300), st.integers(1, 40), st.sampled_from([0, 3, 100]), st.integers(0, 2**31))
@settings(max_examples=80, deadline=None)
def test_support_ranking_equals_full_stable_sort(V, s, distinct, seed):
    """``rank_support`` (topk + small stable sort for large V) == a full stable sort,
    ties (few distinct values), zeros (from -inf logits) included."""
    from rheoplan.distributions import rank_support

    g = torch.Generator().manual_seed(seed)
    q = torch.rand(3, V, generator=g) if distinct == 100 else torch.randint(0, distinct + 1, (3, V), generator=g) / 4.0
    vals, idx = torch.sort(q, dim=-1, descending=True, stable=True)
    tok, sq = rank_support(q, s)
    k = min(s, V)
    assert torch.equal(tok, idx[:, :k]) and torch.equal(sq, vals[:, :k])


@pytest.mark.parametrize("backend", ["reference", "numba", "triton"])
@pytest.mark.parametrize("T,m", [(1.0, 1), (0.7, 0), (0.0, 3)])
def test_subset_logits_plan_the_same_tree_as_dense(backend, T, m):
    """A draft answering over its own vocabulary (``SubsetLogits``: an EAGLE-3 head's 8192 of
    49152 tokens) plans the same tree as the same logits scattered to the whole vocabulary
    with ``-inf`` elsewhere: the same law, so the same support tokens and slots; the
    probabilities agree to float32 rounding (a softmax over fewer columns sums in another
    order). Random logits on random increasing ids, every backend."""
    from rheoplan import plan_tree
    from rheoplan.distributions import SubsetLogits

    V, Vd = 300, 70
    g = torch.Generator().manual_seed(7)
    ids = torch.randperm(V, generator=g)[:Vd].sort().values
    table = torch.randn(V, Vd, generator=g) * 3.0

    def subset(tree, nodes):
        tok = tree.token[0, nodes.clamp(min=0)]
        return SubsetLogits(table[tok.cpu()].to(tree.token.device), ids.to(tree.token.device))

    def dense(tree, nodes):
        return subset(tree, nodes).dense(V)

    cfg = TreeConfig(depth=3, frontier=3, slots=3, budget=8, rheostat=m, support=16)
    s = SamplingConfig(temperature=T)
    a = plan_tree(subset, [5], tree=cfg, sampling=s, seed=3, backend=backend)
    b = plan_tree(dense, [5], tree=cfg, sampling=s, seed=3, backend=backend)
    n = int(b.n_nodes[0])
    assert int(a.n_nodes[0]) == n
    assert torch.equal(a.token[:, :n], b.token[:, :n]) and torch.equal(a.kept, b.kept)
    assert torch.equal(a.sup_token, b.sup_token) and torch.equal(a.sup_n, b.sup_n)
    assert set(a.sup_token[a.sup_token >= 0].tolist()) <= set(ids.tolist())  # mapped to target ids
    torch.testing.assert_close(a.sup_q, b.sup_q, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(a.score[:, :n], b.score[:, :n], rtol=1e-5, atol=1e-5, equal_nan=True)
