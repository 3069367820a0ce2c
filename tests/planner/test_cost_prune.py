"""Passes ``cost_prune`` and ``cost_expand``: the decision rule, and exactness under the
oracle with a fixed calibration (plus a mutation control that peeks at the target)."""

from __future__ import annotations

import itertools
from functools import partial

import pytest
import torch
from hypothesis import HealthCheck, given, settings

from rheoplan import SamplingConfig, TreeConfig, plan_tree
from rheoplan.costmodel import Calibration, CostPlan, Timings, choose_n, node_acceptance
from rheoplan.distributions import target_probs
from rheoplan.ir_text import from_text
from rheoplan.ir import rank_key_order
from rheoplan.models.functional import FunctionalLM, hashed_context_lm
from rheoplan.pipeline import FnPass, PassContext
from rheoplan.planner.cost_depth import another_depth_pays
from rheoplan.planner.cost_prune import cost_prune_tree, decide
from rheoplan.planner.default import cost_pipeline
from rheoplan.testing import enumerate_trees, exact_law, target_law, total_variation
from rheoplan.testing import strategies as rst

TOL = 1e-9

BEFORE = """\
draft_tree B=1 capacity=5 max_expanded=2 support=2 cur_depth=2 rheostat=2 slots=2
tree 0 prefix_len=3 n_nodes=5 n_expanded=2
  %0 = ROOT depth=0 token=9 q=1 w=1 score=0 kept expanded row=0
  %1 = DET parent=%0 depth=1 slot=0 token=1 q=0.95 w=0.95 score=-0.051293295
  %2 = DET parent=%0 depth=1 slot=1 token=2 q=0.05 w=0.05 score=-2.9957323
  %3 = DET parent=%1 depth=2 slot=0 token=3 q=0.85 w=0.85 score=-0.21381973
  %4 = DET parent=%1 depth=2 slot=1 token=4 q=0.15 w=0.15 score=-1.9487104
  row 0 node=%0 n=2 z=0 Y=? q~(Y)=0 y_node=-
    support 1:0.95 2:0.05
  row 1 node=%1 n=2 z=0 Y=? q~(Y)=0 y_node=-
    support 3:0.85 4:0.15
"""


def timings(slope: float, overhead: float = 0.0, draft: float = 0.0) -> Timings:
    """c_v(n) = 10 + slope * (n - 1) at every context length."""
    return Timings((1, 64), (10.0, 10.0 + 63 * slope), (10.0, 10.0 + 63 * slope), 0, 1000,
                   (1,), (draft,), overhead, overhead)


def kept_with(slope: float, cal: Calibration = None) -> list[int]:
    plan = CostPlan.from_calibration(timings(slope), cal or Calibration())
    ctx = PassContext(tree_cfg=TreeConfig(depth=2, frontier=1, slots=2, budget=4, rheostat=2, support=2),
                      sampling=SamplingConfig())
    t = cost_prune_tree(from_text(BEFORE), ctx, plan)
    return [v for v in range(5) if t.kept[0, v]]


@pytest.mark.parametrize("slope", [0.0, 2.0, 20.0])
def test_cost_prune_in_place_through_views_keeps_what_the_copy_keeps(slope):
    """A run that owns its tree (``in_place``) and has its numpy views writes the ``kept``
    table it has, whatever it held, to what the copying pass keeps."""
    plan = CostPlan.from_calibration(timings(slope), Calibration())
    cfg = TreeConfig(depth=2, frontier=1, slots=2, budget=4, rheostat=2, support=2)
    ctx = PassContext(tree_cfg=cfg, sampling=SamplingConfig())
    want = cost_prune_tree(from_text(BEFORE), ctx, plan)
    t = from_text(BEFORE)
    t.kept[:] = True  # a table the pass must clear
    views = {n: getattr(t, n).numpy() for n in ("kept",)}
    got = cost_prune_tree(t, PassContext(tree_cfg=cfg, sampling=SamplingConfig(), in_place=True), plan, views=views)
    assert torch.equal(got.kept, want.kept) and got.kept is t.kept


def test_choose_n_worked_example():
    assert choose_n([0.9, 0.1], 0.0, lambda n: 10.0 * n, 0.0) == (0, 1.0, 10.0)
    n, e, c = choose_n([0.9, 0.8], 0.0, lambda n: 10.0 + n, 0.0)
    assert (n, round(e, 6), c) == (2, 2.7, 13.0)
    # a draft call's cost counts for every N, including N = 0
    assert choose_n([], 5.0, lambda n: 10.0, 1.0) == (0, 1.0, 16.0)


def test_cost_prune_keeps_fewer_nodes_when_verify_tokens_cost_more():
    # prior acceptance = bucket midpoint: %1 0.95, %3 0.95*0.85, %4 0.95*0.15, %2 0.05
    assert kept_with(0.0) == [0, 1, 2, 3, 4]  # a flat c_v: every node pays
    assert kept_with(2.0) == [0, 1, 3]  # the two likely nodes pay, the others do not
    assert kept_with(20.0) == [0]  # nothing pays: a plain autoregressive step


def test_online_calibration_changes_the_decision():
    cal = Calibration()
    # the q=0.95 bucket was never accepted in earlier steps
    cal.trials[0][9] = 50.0
    assert kept_with(2.0, cal) == [0]


def test_kept_set_is_a_prefix_of_the_ranking_and_closed_under_ancestors():
    for seed, slope in itertools.product(range(6), (0.0, 0.5, 2.0)):
        drf = hashed_context_lm(6, seed=seed, sharpness=2.0)
        cfg = TreeConfig(depth=3, frontier=2, slots=3, budget=10, rheostat=1, support=6)
        plan = CostPlan.from_calibration(timings(slope), Calibration())
        from rheoplan.testing.oracle import functional_draft_fn

        t = plan_tree(functional_draft_fn(drf, (0, 1)), [1], tree=cfg, sampling=SamplingConfig(),
                      prefix_len=[1], seed=seed, passes=cost_pipeline(plan))
        n = int(t.n_nodes[0])
        ids = torch.arange(1, n)
        order = ids[rank_key_order(t.score[0, ids], ids)].tolist()
        kept = [v for v in order if t.kept[0, v]]
        assert kept == order[:len(kept)]
        for v in kept:
            assert bool(t.kept[0, int(t.parent[0, v])])
        d = decide(plan, t, cfg.budget)
        assert d.chosen[0] == len(kept)
        a = node_acceptance(plan, t)
        for v in range(1, n):  # acceptance never grows down a path
            assert a[v] <= a[int(t.parent[0, v])] + 1e-12


def test_depth_gate_stops_when_another_draft_call_cannot_pay():
    t = from_text(BEFORE)
    cheap = CostPlan.from_calibration(timings(0.0, draft=0.1), Calibration())
    dear = CostPlan.from_calibration(timings(0.0, draft=1e4), Calibration())
    assert another_depth_pays(cheap, t, frontier=1, budget=8)
    assert not another_depth_pays(dear, t, frontier=1, budget=8)
    root = from_text(BEFORE).replace(cur_depth=0)
    assert another_depth_pays(dear, root, 1, 8)  # depth 1 follows the drafting schedule only
    skip = CostPlan(cheap.timings, cheap.acceptance, cheap.continuation, skip_draft=True)
    assert not another_depth_pays(skip, root, 1, 8)


def test_declined_expand_is_not_decided_again(monkeypatch):
    """Once the gate declines, the later ``expand`` passes of the run get that very tree
    back and return it without deciding again; another tree is decided afresh."""
    from rheoplan.planner import cost_depth

    calls = []
    real = cost_depth.another_depth_pays
    monkeypatch.setattr(cost_depth, "another_depth_pays", lambda *a: calls.append(1) or real(*a))
    dear = CostPlan.from_calibration(timings(0.0, draft=1e4), Calibration())
    inner = FnPass("expand", lambda t, ctx: pytest.fail("a declined depth was drafted"))
    gate = cost_depth.cost_expand(dear, inner)
    ctx = PassContext(tree_cfg=TreeConfig(depth=4, frontier=1, slots=2, budget=8, rheostat=2, support=2),
                      sampling=SamplingConfig())
    t = from_text(BEFORE)
    assert gate(gate(gate(t, ctx), ctx), ctx) is t
    assert len(calls) == 1
    other = from_text(BEFORE)
    assert gate(other, ctx) is other and len(calls) == 2


def test_prune_reuses_the_decision_behind_a_declined_depth(monkeypatch):
    """``cost_pipeline``'s gates and prune share a ``LastDecision``: the prune of the tree a
    gate declined takes the gate's decision; another tree, plan or budget is decided anew,
    and the kept nodes are those of a fresh decision."""
    from rheoplan.planner import cost_depth, cost_prune as cp

    calls = []
    real = cp.decide
    monkeypatch.setattr(cp, "decide", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(cost_depth, "decide", cp.decide)
    dear = CostPlan.from_calibration(timings(0.0, draft=1e4), Calibration())
    inner = FnPass("expand", lambda t, ctx: pytest.fail("a declined depth was drafted"))
    memo = cp.LastDecision()
    gate, prune = cost_depth.cost_expand(dear, inner, memo), cp.cost_prune(dear, None, memo)
    ctx = PassContext(tree_cfg=TreeConfig(depth=4, frontier=1, slots=2, budget=8, rheostat=2, support=2),
                      sampling=SamplingConfig())
    t = from_text(BEFORE)
    kept = prune(gate(t, ctx), ctx).kept
    assert len(calls) == 1
    assert torch.equal(kept, cost_prune_tree(t, ctx, dear).kept) and len(calls) == 2
    prune(from_text(BEFORE), ctx)  # an equal but other tree: decided again
    assert len(calls) == 3
    assert memo(dear, t, 4) is not memo(dear, t, 8) and len(calls) == 5


# -- exactness: the oracle with a fixed calibration --------------------------------------------


def skewed_calibration() -> Calibration:
    """A calibration unlike the prior, so decisions differ from a plain budget cut."""
    cal = Calibration()
    for b in range(10):
        cal.trials[0][b], cal.accepts[0][b] = 10.0, 10.0 * min(1.0, 0.2 + b / 10)
        cal.trials[1][b], cal.accepts[1][b] = 10.0, 10.0 * (0.6 if b % 2 else 0.1)
    cal.cont_trials[1], cal.cont_accepts[1] = 10.0, 3.0
    return cal


@pytest.fixture(scope="module")
def models4():
    return hashed_context_lm(4, seed=31, sharpness=1.5), hashed_context_lm(4, seed=32, sharpness=1.5)


def _shapes(drf, cfg, s, passes):
    """(depth, kept count) of every enumerated tree realisation: the test is not vacuous."""
    return {(int(t.cur_depth), int(t.kept[0].sum()) - 1)
            for _, t in enumerate_trees(drf, (0, 1), cfg, s, passes=passes)}


@pytest.mark.parametrize("verifier,m", [("ot", 1), ("rheo", 1), ("ot", 0), ("onehot", 3)])
@pytest.mark.parametrize("slope,draft", [(0.6, 0.5), (3.0, 0.5), (0.6, 8.0)])
def test_oracle_exact_with_cost_pipeline(models4, verifier, m, slope, draft):
    tgt, drf = models4
    s = SamplingConfig(temperature=1.0)
    cfg = TreeConfig(depth=3, frontier=1, slots=3, budget=6, rheostat=m, support=4, verifier=verifier)
    plan = CostPlan.from_calibration(timings(slope, overhead=1.0, draft=draft), skewed_calibration())
    law = exact_law(tgt, drf, (0, 1), 2, tree=cfg, sampling=s, cost_plan=plan)
    assert abs(sum(law.values()) - 1.0) < 1e-12
    assert total_variation(law, target_law(tgt, (0, 1), 2, s)) <= TOL


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rst.oracle_cases(max_leaves=32, cost=True))
def test_oracle_random_cases_with_random_cost_plans(case):
    """Random models, configs (every verifier, proxy, rheostat) and random frozen latencies
    and calibrations: the decode law equals the target's."""
    assert case.tv() <= TOL, case


@pytest.mark.parametrize("proxy", ["next_rank", "true_q"])
def test_oracle_exact_with_cost_pipeline_other_proxies(models4, proxy):
    tgt, drf = models4
    s = SamplingConfig(temperature=1.0)
    cfg = TreeConfig(depth=3, frontier=1, slots=3, budget=6, rheostat=1, support=4, proxy=proxy)
    plan = CostPlan.from_calibration(timings(0.6, overhead=1.0, draft=0.5), skewed_calibration())
    law = exact_law(tgt, drf, (0, 1), 2, tree=cfg, sampling=s, cost_plan=plan)
    assert total_variation(law, target_law(tgt, (0, 1), 2, s)) <= TOL


def test_oracle_cost_pipeline_trees_vary(models4):
    """The settings above really prune to different sizes and stop at different depths."""
    _, drf = models4
    s = SamplingConfig(temperature=1.0)
    cfg = TreeConfig(depth=3, frontier=1, slots=3, budget=6, rheostat=1, support=4)
    shapes = set()
    for slope, draft in [(0.6, 0.5), (3.0, 0.5), (0.6, 8.0)]:
        plan = CostPlan.from_calibration(timings(slope, overhead=1.0, draft=draft), skewed_calibration())
        shapes |= _shapes(drf, cfg, s, cost_pipeline(plan))
    assert len({n for _, n in shapes}) >= 3 and len({d for d, _ in shapes}) >= 2, shapes


def test_oracle_cost_pipeline_greedy(models4):
    tgt, drf = models4
    s = SamplingConfig(temperature=0.0)
    cfg = TreeConfig(depth=3, frontier=2, slots=2, budget=6, rheostat=1, support=4)
    plan = CostPlan.from_calibration(timings(0.6, overhead=1.0, draft=0.5), skewed_calibration())
    law = exact_law(tgt, drf, (2,), 3, tree=cfg, sampling=s, passes=cost_pipeline(plan))
    assert total_variation(law, target_law(tgt, (2,), 3, s)) <= TOL


# -- mutation control: a variant that peeks at the target's output for this step ----------------


def markov_lm(seed: int, V: int = 4, sharp: float = 2.0) -> FunctionalLM:
    """Logits depend on the last token only, so a pass can evaluate the target from the tree."""
    g = torch.Generator().manual_seed(seed)
    table = torch.randn(V, V, generator=g, dtype=torch.float64) * sharp
    return FunctionalLM(lambda paths: torch.stack([table[p[-1]] for p in paths]), V)


def peeking_prune(tree, ctx, plan, target):
    """LOSSY on purpose: estimates a node's acceptance from the target's probability of its
    token (this step's target output) instead of the calibration."""
    t = tree
    n = int(t.n_nodes[0])
    acc = [1.0] + [0.0] * (n - 1)
    for v in range(1, n):
        par = int(t.parent[0, v])
        p = target_probs(target([(int(t.token[0, par]),)])[0], ctx.sampling)
        acc[v] = float(p[int(t.token[0, v])]) * acc[par]
    ids = torch.arange(1, n)
    order = ids[rank_key_order(t.score[0, ids], ids)].tolist()[: ctx.tree_cfg.budget]
    tm = plan.timings
    N, _, _ = choose_n([acc[v] for v in order], 0.0, lambda k: tm.verify(k, 0), tm.overhead_ms)
    out = t.clone()
    out.kept.zero_()
    out.kept[0, order[:N]] = True
    out.kept[0, 0] = True
    return out


def test_oracle_catches_a_pass_that_peeks_at_the_target():
    """Pruning only moves where the walk stops, so a peek biases the law only through a
    node whose kept-ness depends on the target's view of its own sampled child; the bias
    is small here (about 2e-5 in total variation) but 10^4 times the oracle's tolerance."""
    tgt, drf = markov_lm(7, sharp=3.0), markov_lm(6, sharp=2.0)
    s = SamplingConfig(temperature=1.0)
    cfg = TreeConfig(depth=2, frontier=1, slots=3, budget=6, rheostat=1, support=4, verifier="ot")
    plan = CostPlan.from_calibration(timings(0.3), Calibration())
    honest = cost_pipeline(plan)
    peek = [p if p.name != "prune" else FnPass("prune", partial(peeking_prune, plan=plan, target=tgt))
            for p in honest]
    ref = target_law(tgt, (0, 1), 2, s)
    assert total_variation(exact_law(tgt, drf, (0, 1), 2, tree=cfg, sampling=s, passes=honest), ref) <= TOL
    assert total_variation(exact_law(tgt, drf, (0, 1), 2, tree=cfg, sampling=s, passes=peek), ref) > 1e4 * TOL


# -- batches: the live rows share one verify forward ----------------------------------------------


def batch_timings(fixed: float, per_token: float, draft: float = 0.5) -> Timings:
    """c_v(B, n) = fixed + per_token x B x n on a measured-style grid (and at batch 1)."""
    rows, sizes = (1, 2, 4, 8), (1, 4, 16)
    lo = (fixed + per_token, fixed + 64 * per_token)
    return Timings((1, 64), lo, lo, 0, 1000, (1,), (draft,), 0.0, 0.0, sizes, rows,
                   tuple(tuple(fixed + per_token * B * n for n in rows) for B in sizes))


def batch_tree(B: int, depth: int = 3):
    """B rows of the same tree (top token q ~ 0.47: prior acceptance 0.45 per depth)."""
    cfg = TreeConfig(depth=depth, frontier=1, slots=2, budget=2 * depth, rheostat=2, support=4)
    logits = torch.tensor([2.0, 1.5, 1.0, 0.0])

    def draft(tr, nodes):
        return logits.expand(nodes.shape[0], nodes.shape[1], 4)

    t = plan_tree(draft, [1] * B, tree=cfg, sampling=SamplingConfig(), prefix_len=[64] * B)
    return t, cfg


def test_batch_decision_keeps_trees_on_a_flat_curve_and_drops_them_at_16_rows_when_tokens_cost():
    for B in (1, 4, 16):
        t, cfg = batch_tree(B)
        flat = decide(CostPlan.from_calibration(batch_timings(10.0, 0.0), Calibration()), t, cfg.budget)
        assert flat.chosen == [cfg.budget] * B and flat.pays  # every row keeps its whole budget
    # a fixed 4 ms plus 1 ms per token of the batch: one row's tree pays, sixteen rows' do not
    mixed = CostPlan.from_calibration(batch_timings(4.0, 1.0), Calibration())
    one, cfg = batch_tree(1)
    d1 = decide(mixed, one, cfg.budget)
    assert d1.chosen[0] >= 1 and d1.pays
    sixteen, _ = batch_tree(16)
    d16 = decide(mixed, sixteen, cfg.budget)
    assert d16.chosen == [0] * 16 and not d16.pays  # a plain autoregressive step for every row
    # and the depth gate agrees: after depth 1, a second depth pays for 16 rows on a flat
    # curve, not when every token of the batch costs
    shallow, cfg1 = batch_tree(16, depth=1)
    flat = CostPlan.from_calibration(batch_timings(10.0, 0.0), Calibration())
    assert another_depth_pays(flat, shallow, cfg1.frontier, budget=4)
    assert not another_depth_pays(mixed, shallow, cfg1.frontier, budget=4)


def test_batch_decision_prices_the_padded_forward_and_one_draft_call_per_depth():
    t, cfg = batch_tree(4)
    tm = batch_timings(4.0, 0.3)
    d = decide(CostPlan.from_calibration(tm, Calibration()), t, cfg.budget)
    assert sum(d.chosen) > 0
    widest = 1 + max(d.chosen)
    depths = sorted(set(t.depth[0, t.exp_node[0, :int(t.n_expanded[0])]].tolist()))
    assert d.draft_ms == pytest.approx(sum(tm.draft_batch(4, 1) for _ in depths))  # one call per depth
    assert d.predicted_ms == pytest.approx(d.draft_ms + tm.verify_batch(4, widest, 64) + tm.overhead_batch(4))
    assert d.ar_ms == pytest.approx(tm.ar_step_batch(4, 64))
    assert d.expected == pytest.approx(4 + sum(sum(d.est_accept[b][v] for v in d.order[b][:d.chosen[b]])
                                              for b in range(4)))


def test_each_drafted_depth_adds_its_bookkeeping_to_the_price():
    """The decision prices the step's bookkeeping at the depth drafted so far
    (``Timings.tree_overhead``), and the gate charges the next depth's share: bookkeeping dear
    enough per depth stops drafting where a flat c_o would go on."""
    from dataclasses import replace

    t, cfg = batch_tree(1)
    flat = batch_timings(10.0, 0.0)
    deep = replace(flat, overhead_ms=1.0, overhead_depth_ms=50.0)
    d = decide(CostPlan.from_calibration(deep, Calibration()), t, cfg.budget)
    assert t.cur_depth == 3
    assert d.predicted_ms == pytest.approx(d.draft_ms + deep.verify(1 + d.chosen[0], 64) + 1.0 + 2 * 50.0)
    shallow = t.replace(cur_depth=1)
    assert another_depth_pays(CostPlan.from_calibration(flat, Calibration()), shallow, cfg.frontier, cfg.budget)
    assert not another_depth_pays(CostPlan.from_calibration(deep, Calibration()), shallow, cfg.frontier, cfg.budget)


def test_a_batch_goes_as_fast_as_its_slowest_row_and_no_row_waits_while_rows_join():
    """``slowest_row_tokens``: ``E`` for one row and while rows wait to join; else ``E -
    z_B * ROW_SPREAD * (E - 1)``, ``z_B`` how far the slowest of B rows lags in standard
    deviations (checked against a simulation): less with more rows, and a plain step's one
    token is every row's. ``CostDecision.pays`` (the cost passes' batch verdict) holds a
    tree to it."""
    from rheoplan.costmodel import ROW_SPREAD, expected_max_normal, slowest_row_tokens
    from planner.cost_prune import CostDecision

    g = torch.Generator().manual_seed(0)
    for n in (2, 3, 4, 8, 16):
        sim = torch.randn(200_000, n, generator=g, dtype=torch.float64).amax(dim=1).mean().item()
        assert expected_max_normal(n) == pytest.approx(sim, abs=0.01), n
    e = [slowest_row_tokens(2.5, b) for b in (1, 2, 3, 4, 8, 16)]
    assert e[0] == 2.5 and all(a > b for a, b in zip(e, e[1:])), e
    assert e[3] == pytest.approx(2.5 - 1.0294 * ROW_SPREAD * 1.5, abs=1e-4)
    assert [slowest_row_tokens(2.5, b, rows_waiting=True) for b in (1, 2, 4, 16)] == [2.5] * 4
    assert slowest_row_tokens(1.0, 16) == 1.0

    def decision(rows: int, per_row: float) -> CostDecision:
        ar_ms = 10.0  # a plain step: `rows` tokens in 10 ms; the tree: `per_row` tokens a row in 20 ms
        return CostDecision([[1.0]] * rows, [[]] * rows, [0] * rows, expected=rows * per_row,
                            predicted_ms=2.0 * ar_ms, ar_ms=ar_ms, draft_ms=1.0)

    assert decision(1, 2.01).pays and not decision(1, 1.99).pays
    for rows in (2, 4, 16):
        # the slowest row must make 2 tokens a step: E - z * s * (E - 1) = 2
        edge = (2.0 - expected_max_normal(rows) * ROW_SPREAD) / (1.0 - expected_max_normal(rows) * ROW_SPREAD)
        assert decision(rows, edge * 1.01).pays and not decision(rows, edge * 0.99).pays
