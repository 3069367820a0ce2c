"""Pass ``assign``: the sampled token Y, its tail-law probability, PAD filling."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rheoplan import SamplingConfig, TreeConfig
from rheoplan.distributions import tail_law
from rheoplan.ir import empty_tree
from rheoplan.pipeline import PassContext
from rheoplan.planner.assign import assign, gumbel_sampler
from rheoplan.planner.expand import expand
from rheoplan.rng import Streams

Q = [0.4, 0.3, 0.2, 0.1]


def expanded_root(cfg: TreeConfig, q=Q, sampler=None):
    logq = torch.log(torch.tensor(q))
    draft = lambda t, nodes: logq.expand(nodes.shape[0], nodes.shape[1], len(q)).clone()  # noqa: E731
    ctx = PassContext(tree_cfg=cfg, sampling=SamplingConfig(), draft=draft, sampler=sampler)
    t = empty_tree(1, cfg.capacity, cfg.max_expanded, cfg.support, torch.tensor([0]), torch.tensor([0]),
                   cfg.rheostat, cfg.slots)
    return expand(t, ctx), ctx


@pytest.mark.parametrize("i, y, pads", [(0, 1, [2]), (1, 2, [1]), (2, 3, [1])])
def test_assign_before_after(i, y, pads):
    cfg = TreeConfig(depth=1, frontier=1, slots=3, budget=3, rheostat=1, support=4)
    before, ctx = expanded_root(cfg, sampler=lambda b, v, qt: i)
    after = assign(before, ctx)
    assert int(after.y_token[0, 0]) == y and int(after.token[0, 2]) == y
    assert after.token[0, 3:4].tolist() == pads  # best tail token other than Y
    assert float(after.y_qtilde[0, 0]) == pytest.approx(Q[y] / 0.6)
    assert float(after.q[0, 2]) == pytest.approx(Q[y])
    assert float(after.weight[0, 2]) == pytest.approx(0.4)  # default proxy: untouched by Y
    assert int(before.y_token[0, 0]) == -1 and int(before.token[0, 2]) == -1, "assign mutated its input"


def test_true_q_proxy_scores_the_drawn_token():
    cfg = TreeConfig(depth=1, frontier=1, slots=2, budget=2, rheostat=1, support=4, proxy="true_q")
    t, ctx = expanded_root(cfg, sampler=lambda b, v, qt: 2)
    t = assign(t, ctx)
    assert float(t.weight[0, 2]) == pytest.approx(0.1)
    assert float(t.score[0, 2]) == pytest.approx(torch.log(torch.tensor(0.1)).item())


@given(st.lists(st.integers(1, 20), min_size=3, max_size=8), st.data())
@settings(max_examples=60, deadline=None)
def test_pad_slots_are_best_tail_ranks_skipping_y(weights, data):
    V = len(weights)
    q = (torch.tensor(weights, dtype=torch.float64) / sum(weights)).tolist()
    K = data.draw(st.integers(2, V))
    m = data.draw(st.integers(0, K - 1))
    cfg = TreeConfig(depth=1, frontier=1, slots=K, budget=K, rheostat=m, support=V)
    i = data.draw(st.integers(0, V - m - 1))
    t, ctx = expanded_root(cfg, q=q, sampler=lambda b, v, qt: i)
    t = assign(t, ctx)
    ranked = t.sup_token[0, 0].tolist()
    y = ranked[m + i]
    assert int(t.y_token[0, 0]) == y
    want_pads = [r for r in ranked[m:] if r != y][: K - m - 1]
    assert t.token[0, 2 + m: 1 + K].tolist() == want_pads
    assert t.token[0, 1: 1 + m].tolist() == ranked[:m]
    qt = tail_law(t.sup_q[0, 0], m, V)
    assert float(t.y_qtilde[0, 0]) == pytest.approx(float(qt[i]), rel=1e-6)


def test_no_sampled_slot_is_a_no_op():
    cfg = TreeConfig(depth=1, frontier=1, slots=3, budget=3, rheostat=3, support=4)
    t, ctx = expanded_root(cfg, sampler=lambda b, v, qt: 0)
    assert assign(t, ctx) is t


def test_bad_sampler_and_missing_sampler_are_named():
    cfg = TreeConfig(depth=1, frontier=1, slots=3, budget=3, rheostat=1, support=4)
    t, ctx = expanded_root(cfg, sampler=lambda b, v, qt: 3)
    with pytest.raises(ValueError, match=r"tail index 3, allowed \[0, 3\)"):
        assign(t, ctx)
    ctx.sampler = None
    with pytest.raises(ValueError, match="ctx.sampler"):
        assign(t, ctx)


def test_gumbel_sampler_draws_the_tail_law():
    qt = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)
    draw = gumbel_sampler(Streams(1234), step=0)
    n = 3000
    counts = torch.bincount(torch.tensor([draw(0, node, qt) for node in range(n)]), minlength=4)
    # 4-sigma binomial bounds per cell (false alarm about 1e-4 for the fixed seed anyway)
    sigma = torch.sqrt(n * qt * (1 - qt))
    assert ((counts - n * qt).abs() <= 4 * sigma).all(), counts.tolist()
    assert draw(0, 7, qt) == draw(0, 7, qt)  # counter-based: reproducible
