"""The numba cost decision (``kernels/plan/cpu_pass.decide``) against its reference
(``planner/cost_prune.decide``): the same ``CostDecision``, compared with ``==`` (every
acceptance, the ranking, the rows' shares of N*, the predicted tokens and milliseconds to
the bit), on trees and batches from the real pipeline with random calibrations, ties,
``-inf`` and NaN scores, pending tokens, and budgets from 0 to more than a tree holds."""

from __future__ import annotations

import random

import pytest
import torch

from rheoplan import SamplingConfig, TreeConfig, plan_tree
from rheoplan.costmodel import Calibration, CostPlan, Timings
from rheoplan.kernels.plan.cpu_pass import decide as numba_decide, frontiers as numba_frontiers
from rheoplan.planner.cost_depth import frontiers
from rheoplan.planner.cost_prune import LastDecision, decide
from rheoplan.planner.default import cost_pipeline


def _plan(seed: int, slope: float, scale: float) -> CostPlan:
    rnd = random.Random(seed)
    cal = Calibration()
    for c in range(len(cal.trials)):
        for b in range(len(cal.trials[c])):
            cal.trials[c][b] = rnd.uniform(0, 20)
            cal.accepts[c][b] = rnd.uniform(0, cal.trials[c][b])
    rows, sizes = (1, 2, 4, 8, 16), (1, 4, 16)
    grid = tuple(tuple(10.0 + slope * B * n * rnd.uniform(0.8, 1.2) for n in rows) for B in sizes)
    tm = Timings((1, 8, 64), (10.0, 10.5 + slope, 10.0 + 63 * slope), (11.0, 12.0 + slope, 12.0 + 63 * slope),
                 0, 1000, (1, 3), (0.5, 0.9), 0.7, 0.3, sizes, rows, grid, (0.6, 1.1, 3.0), 2.0,
                 (0.7, 2.5, 9.0), (0.3, 1.0, 4.0), (1.0, 1.05, 0.95), (1.0, 0.9, 0.7),
                 overhead_depth_ms=0.4)
    p = CostPlan.from_calibration(tm, cal)
    return CostPlan(p.timings, p.acceptance, p.continuation, False, scale)


def _tree(seed: int, rheostat: int, B: int = 1):
    V = 12
    g = torch.Generator().manual_seed(seed)
    bank = torch.round(torch.randn(40, V, generator=g) * 1.5)  # rounded: equal scores happen
    rows = torch.arange(B)[:, None]
    draft = lambda t, nodes: bank[(nodes.clamp(min=0) * 3 + t.cur_depth + 5 * rows) % 40]  # noqa: E731
    cfg = TreeConfig(depth=3, frontier=3, slots=3, budget=12, rheostat=rheostat, support=6)
    return plan_tree(draft, list(range(1, B + 1)), tree=cfg, sampling=SamplingConfig(),
                     prefix_len=[7 * (b + 1) for b in range(B)], seed=seed)


@pytest.mark.parametrize("seed", range(12))
def test_numba_decision_equals_the_reference(seed):
    t = _tree(seed, rheostat=seed % 3)
    n = int(t.n_nodes[0])
    variants = [t]
    score = t.score.clone()
    score[0, 2:n:5] = float("-inf")
    score[0, 3:n:7] = float("nan")
    score[0, 1:n:4] = score[0, 1]  # ties with node 1: the lower id ranks first
    variants.append(t.replace(score=score))
    token = t.token.clone()
    token[0, 4:n:6] = -1  # pending tokens: no acceptance, not a candidate
    variants.append(t.replace(token=token))
    for tree in variants:
        for slope in (0.0, 0.3, 3.0):
            for scale in (1.0, 1.7, 0.6):
                plan = _plan(seed, slope, scale)
                for budget in (0, 1, 4, 12, 40):
                    assert numba_decide(plan, tree, budget) == decide(plan, tree, budget), (slope, scale, budget)


def test_equal_rates_go_to_the_smaller_tree():
    """Every candidate's acceptance scaled to 0 on a flat verify curve: every N predicts the
    same tokens per ms, and the tie goes to N = 0, as in ``choose_n``."""
    t = _tree(1, rheostat=1)
    p = _plan(1, 0.0, 0.0)
    flat = Timings((1, 64), (10.0, 10.0), (10.0, 10.0), 0, 1000, (1,), (0.0,), 0.0, 0.0)
    plan = CostPlan(flat, p.acceptance, p.continuation, False, 0.0)
    d = numba_decide(plan, t, 12)
    assert d == decide(plan, t, 12) and d.chosen == [0] and len(d.order[0]) == 12


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("B", [2, 4, 7])
def test_numba_batch_decision_equals_the_reference(seed, B):
    """Rows of one batch compete for one padded forward: the merge (ties to the lower row),
    the widest row's price, one batched draft call per depth, each row's share of N*."""
    t = _tree(seed, rheostat=seed % 3, B=B)
    score = t.score.clone()
    score[:, 2::5] = float("-inf")
    score[1:, 1::4] = score[0, 1]  # equal acceptances across rows happen: ties to the lower row
    token = t.token.clone()
    token[B - 1, 3::6] = -1
    for tree in (t, t.replace(score=score), t.replace(token=token)):
        for slope in (0.0, 0.05, 1.0):
            for scale in (1.0, 1.4, 0.5):
                plan = _plan(seed, slope, scale)
                for budget in (0, 2, 12, 40):
                    assert numba_decide(plan, tree, budget) == decide(plan, tree, budget), (slope, scale, budget)


def _cost_tree(plan: CostPlan, seed: int, **impls):
    """A depth-3 tree planned by ``cost_pipeline(plan, **impls)`` over a random draft."""
    cfg = TreeConfig(depth=3, frontier=2, slots=3, budget=8, rheostat=1, support=6)
    bank = torch.randn(40, 12, generator=torch.Generator().manual_seed(seed))
    draft = lambda t, nodes: bank[(nodes.clamp(min=0) * 3 + t.cur_depth) % 40]  # noqa: E731
    return plan_tree(draft, [1], tree=cfg, sampling=SamplingConfig(), prefix_len=[9], seed=seed,
                     passes=cost_pipeline(plan, **impls))


def test_cost_pipeline_takes_the_numba_decision():
    """``cost_pipeline(decide=...)``: the gates and the prune call that implementation (and
    plan the same tree as the reference)."""
    calls = []

    def counted(plan, tree, budget):
        calls.append(budget)
        return numba_decide(plan, tree, budget)

    plan = _plan(5, 0.3, 1.0)
    fast, ref = _cost_tree(plan, 5, decide=counted), _cost_tree(plan, 5)
    assert calls
    assert torch.equal(fast.kept, ref.kept) and torch.equal(fast.linear.token, ref.linear.token)
    assert LastDecision(counted)(plan, ref, 8) == decide(plan, ref, 8)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("B", [1, 3])
def test_numba_frontiers_equal_the_reference(seed, B):
    """The cost gates' frontier (``cost_depth.frontiers``): the same node lists, best
    first, with ties (the lower id first), ``-inf`` and NaN scores (NaN last), at every
    level a tree has and for frontiers wider than a level."""
    t = _tree(seed, rheostat=seed % 3, B=B)
    score = t.score.clone()
    score[:, 2::5] = float("-inf")
    score[:, 3::7] = float("nan")
    score[:, 1::4] = score[0, 1]
    for tree in (t, t.replace(score=score)):
        for level in range(tree.cur_depth + 1):
            at = tree.replace(cur_depth=level)
            for k in (1, 2, 3, 20):
                got = numba_frontiers(at, k)
                assert got == frontiers(at, k), (level, k)
                assert len(got) == B and all(len(f) <= k for f in got)


def test_cost_pipeline_takes_the_numba_frontiers():
    """``cost_pipeline(frontiers=...)``: the gates call that implementation, and the tree
    is the reference's."""
    calls = []

    def counted(tree, k):
        calls.append(k)
        return numba_frontiers(tree, k)

    plan = _plan(3, 0.0, 1.0)
    fast, ref = _cost_tree(plan, 3, frontiers=counted), _cost_tree(plan, 3)
    assert calls == [2] * len(calls) and calls
    assert torch.equal(fast.kept, ref.kept) and torch.equal(fast.linear.token, ref.linear.token)


@pytest.mark.parametrize("seed", range(6))
def test_verify_table_equals_verify_batch_bit_for_bit(seed):
    """``decide``'s one-row verify curve (``Timings.verify_ends`` once per timings, then
    ``Timings.at_ctx`` on arrays per context) gives ``Timings.verify_batch`` to the bit at
    every tree size, for contexts below, inside and past the measured range (where the
    extrapolated latency is floored at 1e-3 ms), reusing the ends across contexts."""
    from rheoplan.kernels.plan.cpu_pass import _verify_table

    rnd = random.Random(seed)
    sizes = (1, 2, 4, 8, 16, 32, 64)
    lo = tuple(rnd.uniform(5, 40) + 1.7 * n for n in sizes)
    hi = tuple(v + rnd.uniform(-3, 30) for v in lo)  # may fall with the context: floored at 1e-3
    tm = Timings(sizes, lo, hi, rnd.randint(0, 100), rnd.randint(200, 900), (1, 3), (4.3, 4.6), 5.4, 3.0)
    for ctx in [0, 1, tm.ctx_lo, 157, tm.ctx_hi, 2000, 40000] + [rnd.randint(0, 3000) for _ in range(20)]:
        for upto in (1, 9, 33, 80):
            table = _verify_table(tm, 1, ctx, upto)
            assert table.shape[0] > upto and table[0] == 0.0
            assert table[1:upto + 1].tolist() == [tm.verify_batch(1, k, ctx) for k in range(1, upto + 1)], (ctx, upto)
