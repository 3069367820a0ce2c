"""The cost model's quantities: latency interpolation, online calibration, the schedule, the cache."""

from __future__ import annotations

import json
import math
import random
from dataclasses import replace

import pytest
import torch

from rheoplan import SamplingConfig, TreeConfig, plan_tree
from rheoplan.costmodel import (PLAN_WIDTHS, ROW_SPREAD, Calibration, CostModel, ProjectionTimings, Timings, cache_key,
                                cache_read, cache_write, measure_projection, node_class, prefill_groups,
                                projection_timings, slowest_row_tokens, weight_bucket)
from rheoplan.ir import NodeKind
from rheoplan.models.functional import hashed_context_lm
from rheoplan.testing.oracle import functional_draft_fn


def tm(**kw) -> Timings:
    d = dict(sizes=(1, 4, 16), verify_lo=(10.0, 16.0, 40.0), verify_hi=(20.0, 30.0, 80.0), ctx_lo=100,
             ctx_hi=300, draft_widths=(1, 3), draft_ms=(2.0, 3.0), overhead_ms=1.5, ar_overhead_ms=0.5)
    d.update(kw)
    return Timings(**d)


def test_verify_latency_is_piecewise_linear_in_tokens_and_linear_in_context():
    t = tm()
    assert t.verify(1, 100) == 10.0 and t.verify(4, 300) == 30.0
    assert t.verify(2, 100) == pytest.approx(12.0)  # between 1 and 4 tokens
    assert t.verify(1, 200) == pytest.approx(15.0)  # halfway between the two contexts
    assert t.verify(28, 100) == pytest.approx(64.0)  # extrapolated past 16 tokens
    assert t.draft(2) == pytest.approx(2.5) and t.ar_step(100) == 10.5
    assert Timings.from_dict(t.to_dict()) == t


@pytest.mark.parametrize("bad,match", [
    (dict(sizes=(4, 1, 16)), "increasing"), (dict(verify_lo=(1.0, 2.0)), "equal length"),
    (dict(ctx_hi=100), "ctx_hi"), (dict(draft_ms=(-1.0, 2.0)), ">= 0"),
    (dict(overhead_ms=float("nan")), "finite"),
])
def test_timings_reject_bad_input(bad, match):
    with pytest.raises(ValueError, match=match):
        tm(**bad)


def test_buckets_and_classes():
    assert [weight_bucket(w) for w in (0.0, 0.05, 0.35, 0.999, 1.0)] == [0, 0, 3, 9, 9]
    assert node_class(int(NodeKind.SAMPLED)) == 1
    assert node_class(int(NodeKind.DET)) == node_class(int(NodeKind.PAD)) == 0


def test_prior_is_the_bucket_midpoint_and_counts_move_it():
    cal = Calibration()
    assert cal.acceptance()[0][3] == pytest.approx(0.35)
    cal.trials[0][3], cal.accepts[0][3] = 8.0, 8.0
    assert cal.acceptance()[0][3] == pytest.approx((8 + 0.7) / 10)


def test_a_depth_never_reached_continues_as_the_one_above():
    cal = Calibration()
    assert cal.continuation()[:3] == (0.5, 0.5, 0.5)
    cal.cont_trials[0], cal.cont_accepts[0] = 8.0, 8.0
    cal.cont_trials[2], cal.cont_accepts[2] = 8.0, 0.0
    c = cal.continuation()
    assert c[0] == pytest.approx((8 + 1.0) / 10) and c[1] == pytest.approx(c[0])  # depth 1: no counts
    assert c[2] == pytest.approx((0 + 2 * c[1]) / 10) and c[3] == pytest.approx(c[2])


def test_continuation_of_the_first_depths_only_is_a_prefix_and_checks_its_input():
    cal = Calibration()
    for d in range(5):
        cal.cont_trials[d], cal.cont_accepts[d] = 10.0 + d, 7.0 - d
        cal.width_trials[d] = [9.0, 8.0, 7.0]
        cal.width_accepts[d] = [3.0, 4.0, 5.0 - d]
    for w in (None, 1, 2, 3):
        for n in (0, 1, 4, len(cal.cont_trials)):
            assert cal.continuation(w, depths=n) == cal.continuation(w)[:n]
    for bad in (-1, len(cal.cont_trials) + 1, 2.0, True):
        with pytest.raises(ValueError, match="depths="):
            cal.continuation(1, depths=bad)


def test_update_counts_the_kept_children_of_the_accepted_path():
    drf = hashed_context_lm(6, seed=3, sharpness=2.0)
    cfg = TreeConfig(depth=2, frontier=1, slots=2, budget=4, rheostat=1, support=6)
    t = plan_tree(functional_draft_fn(drf, (0, 1)), [1], tree=cfg, sampling=SamplingConfig(), prefix_len=[1])
    lin = t.linear
    first, nk = int(lin.first_child[0, 0]), int(lin.n_children[0, 0])
    child = first  # the walk accepted the root's first kept child, then stopped
    cal = Calibration()
    cal.update(t, [0, child])
    n_trials = nk + int(lin.n_children[0, child])
    assert sum(map(sum, cal.trials)) == n_trials and sum(map(sum, cal.accepts)) == 1
    v = int(lin.node[0, child])
    c, b = node_class(int(t.kind[0, v])), weight_bucket(float(t.weight[0, v]))
    assert cal.accepts[c][b] == 1
    assert cal.cont_trials[0] == 1 and cal.cont_accepts[0] == 1
    assert cal.cont_trials[1] == (1 if int(lin.n_children[0, child]) else 0) and cal.cont_accepts[1] == 0


def test_calibration_file_round_trip_and_errors(tmp_path):
    cal = Calibration()
    cal.trials[1][2], cal.accepts[1][2] = 5.0, 2.0
    f = tmp_path / "cal.json"
    cal.save(f)
    assert Calibration.load(f) == cal
    with pytest.raises(ValueError, match="no such file"):
        Calibration.load(tmp_path / "missing.json")
    f.write_text('{"trials": [[1]], "accepts": [[0]]}')
    with pytest.raises(ValueError, match="2 lists of 10"):
        Calibration.load(f)
    bad = cal.to_dict()
    bad["accepts"][0][0] = 3.0
    with pytest.raises(ValueError, match="accepts <= trials"):
        Calibration.from_dict(bad)


def test_update_counts_each_width_by_the_accepted_childs_place():
    """``width_trials[d][w - 1]`` counts reached nodes with at least ``w`` kept children;
    ``width_accepts`` those whose walk went on through one of the first ``w``: a node whose
    second child was accepted continues as a node of 2 or 3 children would, not as one of 1."""
    drf = hashed_context_lm(6, seed=3, sharpness=2.0)
    cfg = TreeConfig(depth=2, frontier=1, slots=3, budget=5, rheostat=1, support=6)
    t = plan_tree(functional_draft_fn(drf, (0, 1)), [1], tree=cfg, sampling=SamplingConfig(), prefix_len=[1])
    lin = t.linear
    first, nk = int(lin.first_child[0, 0]), int(lin.n_children[0, 0])
    assert nk >= 2
    second = first + 1
    cal = Calibration()
    cal.update(t, [0, second])  # the root's second kept child accepted, then the walk stopped
    widths = min(nk, PLAN_WIDTHS)
    assert cal.width_trials[0] == [1.0] * widths + [0.0] * (PLAN_WIDTHS - widths)
    assert cal.width_accepts[0] == [0.0, 1.0, 1.0][:widths] + [0.0] * (PLAN_WIDTHS - widths)
    kids = min(int(lin.n_children[0, second]), PLAN_WIDTHS)  # the second child's own children: no accept
    assert cal.width_trials[1] == [1.0] * kids + [0.0] * (PLAN_WIDTHS - kids) and sum(cal.width_accepts[1]) == 0
    # continuation(width): the counts over a prior at the all-children rate
    every = cal.continuation()
    assert cal.continuation(1)[0] == pytest.approx((0 + 2.0 * every[0]) / (1 + 2.0))
    assert cal.continuation(2)[0] == pytest.approx((1 + 2.0 * every[0]) / (1 + 2.0))
    assert Calibration().continuation(2) == Calibration().continuation()  # no counts: the prior
    for bad in (0, PLAN_WIDTHS + 1, True, 1.0):
        with pytest.raises(ValueError, match="width"):
            cal.continuation(bad)


def test_width_counts_round_trip_cap_and_older_files(tmp_path):
    cal = Calibration()
    cal.width_trials[2] = [40.0, 20.0, 10.0]
    cal.width_accepts[2] = [10.0, 10.0, 5.0]
    f = tmp_path / "cal.json"
    cal.save(f)
    assert Calibration.load(f) == cal
    capped = cal.capped(20.0)
    assert capped.width_trials[2] == [20.0, 20.0, 10.0] and capped.width_accepts[2] == [5.0, 10.0, 5.0]
    old = cal.to_dict()
    del old["width_trials"], old["width_accepts"]  # a file from before the width counts
    assert Calibration.from_dict(old).width_trials == Calibration().width_trials
    bad = cal.to_dict()
    bad["width_accepts"][2][0] = 50.0
    with pytest.raises(ValueError, match="accepts <= trials"):
        Calibration.from_dict(bad)
    bad["width_accepts"][2] = [1.0]
    with pytest.raises(ValueError, match="width_accepts"):
        Calibration.from_dict(bad)


def test_cache_keeps_other_keys(tmp_path, monkeypatch):
    monkeypatch.setenv("RHEOPLAN_CACHE_DIR", str(tmp_path))
    k1, k2 = cache_key("x", "model-a"), cache_key("x", "model-b", dtype="bfloat16")
    assert k1 != k2 and "torch " in k1 and "threads" in k1
    cache_write("c.json", k1, {"v": 1})
    cache_write("c.json", k2, {"v": 2})
    assert cache_read("c.json", k1) == {"v": 1} and cache_read("c.json", k2) == {"v": 2}
    assert cache_read("c.json", "nope") is None and cache_read("none.json", k1) is None


# -- batches: the verify grid and the a-priori plan per batch size ---------------------------------


def grid_tm(**kw) -> Timings:
    """tm() plus a batched verify grid: B (1, 4) x n (1, 2) at ctx_lo."""
    return tm(batch_sizes=(1, 4), batch_row_sizes=(1, 2), batch_verify=((10.0, 12.0), (14.0, 22.0)), **kw)


def test_verify_batch_interpolates_the_grid_and_adds_the_context_term():
    t = grid_tm()
    assert t.verify_batch(1, 4, 200) == t.verify(4, 200)  # batch 1 is the batch-1 curve
    assert t.verify_batch(4, 2, 100) == pytest.approx(22.0)  # a grid point at ctx_lo
    assert t.verify_batch(2, 1, 100) == pytest.approx(10.0 + 4.0 / 3)  # between B = 1 and 4
    assert t.verify_batch(4, 3, 100) == pytest.approx(30.0)  # extrapolated past n = 2
    # context: the batch-1 curve's ctx term at the batch's total tokens (4 x 1 = 4: 16 -> 30)
    assert t.verify_batch(4, 1, 300) == pytest.approx(14.0 + 14.0)
    # no grid: a batch is priced as one row of B * n tokens
    assert tm().verify_batch(4, 1, 100) == tm().verify(4, 100)
    assert t.draft_batch(3, 1) == t.draft(3) and t.overhead_batch(4) == 4 * t.overhead_ms
    assert t.ar_step_batch(4, 100) == pytest.approx(14.0 + 4 * t.ar_overhead_ms)


def test_latencies_read_twice_are_the_same_numbers_and_stay_out_of_the_record():
    """``Timings`` keeps the context-free parts of ``verify_ends`` / ``verify_batch`` once
    computed: a second read, at any context, is what a fresh ``Timings`` computes, and
    the kept parts are neither compared nor saved."""
    t = grid_tm(batch_tree_scale=(1.0, 1.1), batch_ar_scale=(1.0, 0.9))
    reads = [(B, n, ctx) for B in (1, 2, 4, 7) for n in (1, 2, 3, 9) for ctx in (100, 150, 333)]
    first = [t.verify_batch(*r) for r in reads] + [t.verify_ends(n) for n in (1, 5, 64)]
    again = [t.verify_batch(*r) for r in reversed(reads)][::-1] + [t.verify_ends(n) for n in (1, 5, 64)]
    fresh = [grid_tm(batch_tree_scale=(1.0, 1.1), batch_ar_scale=(1.0, 0.9)).verify_batch(*r) for r in reads]
    assert first == again and first[:len(reads)] == fresh
    assert t == grid_tm(batch_tree_scale=(1.0, 1.1), batch_ar_scale=(1.0, 0.9))
    assert Timings.from_dict(t.to_dict()) == t and "_memo" not in t.to_dict()


def test_timings_with_a_grid_round_trip_and_old_records_still_load():
    t = grid_tm()
    assert Timings.from_dict(t.to_dict()) == t
    old = tm().to_dict()
    for k in ("batch_sizes", "batch_row_sizes", "batch_verify"):
        del old[k]
    assert Timings.from_dict(old) == tm() and tm().batch_sizes == ()


@pytest.mark.parametrize("bad,match", [
    (dict(batch_sizes=(4, 1), batch_row_sizes=(1,), batch_verify=((1.0,), (2.0,))), "batch_sizes"),
    (dict(batch_sizes=(1,), batch_row_sizes=(), batch_verify=((1.0,),)), "batch_row_sizes"),
    (dict(batch_sizes=(1, 4), batch_row_sizes=(1, 2), batch_verify=((1.0, 2.0),)), "batch_verify must be 2 rows"),
    (dict(batch_sizes=(1,), batch_row_sizes=(1,), batch_verify=((-1.0,),)), ">= 0"),
])
def test_timings_reject_a_bad_grid(bad, match):
    with pytest.raises(ValueError, match=match):
        tm(**bad)


def linear_tm(fixed: float, per_token: float, draft: float = 0.5, overhead: float = 0.0) -> Timings:
    """c_v = fixed + per_token x (the batch's total tokens), on a B x n grid and at batch 1."""
    rows, sizes = (1, 2, 4, 8), (1, 4, 16)
    return Timings((1, 64), (fixed + per_token, fixed + 64 * per_token), (fixed + per_token, fixed + 64 * per_token),
                   0, 1000, (1,), (draft,), overhead, overhead, sizes, rows,
                   tuple(tuple(fixed + per_token * B * n for n in rows) for B in sizes))


@pytest.mark.parametrize("seed", range(6))
def test_plan_rows_is_the_best_width_of_plan_for_batch(seed):
    """``plan_rows`` reads each latency once for every width it tries: the same plan, to the
    bit, as ``plan_for_batch`` at each width, and both maximise the documented rate
    ``B * slowest(E(D)) / cost(D)`` (written out here), on random latencies, rates per width
    and contexts."""
    rng = random.Random(seed)
    sizes = (1, 4, 16)
    t = Timings((1, 16, 64), (10.0, 12.0 + rng.random(), 20.0), (11.0, 14.0, 25.0 + rng.random()), 64, 512,
                (1, 3), (1.0, 0.8), 3.0, 2.0, sizes, (1, 4, 16),
                tuple(tuple(10.0 + B * n * rng.uniform(0.05, 0.6) for n in (1, 4, 16)) for B in sizes),
                batch_draft_ms=(1.0, 2.0, 4.5), batch_draft_width=2.0, batch_overhead_ms=(3.0, 5.0, 17.0),
                batch_overhead_depth_ms=(0.4, rng.uniform(0.5, 3.0), 4.0), batch_ar_overhead_ms=(2.0, 2.5, 4.0))
    cal = Calibration()
    for d in range(6):
        cal.cont_trials[d], cal.cont_accepts[d] = 100.0, rng.uniform(40, 95)
        cal.width_trials[d] = [100.0] * PLAN_WIDTHS
        cal.width_accepts[d] = sorted(rng.uniform(30, 95) for _ in range(PLAN_WIDTHS))
    cost = CostModel(t)
    for B in (2, 4, 9):
        for ctx in (70, 333):
            for waiting in (False, True):
                want, best = None, (B / t.ar_step_batch(B, ctx) * 1e3, 0, 1)
                for w in range(1, PLAN_WIDTHS + 1):
                    p = cost.plan_for_batch(B, ctx=ctx, max_depth=6, width=w, continuation=cal.continuation(w),
                                            rows_waiting=waiting)
                    if want is None or p.tokens_per_s > want.tokens_per_s:
                        want = p
                    e, reach = 1.0, 1.0
                    for d in range(1, 7):
                        reach *= cal.continuation(w)[d - 1]
                        e += reach
                        ms = d * t.draft_batch(B, w) + t.verify_batch(B, 1 + w * d, ctx) + t.tree_overhead(B, d)
                        rate = B * slowest_row_tokens(e, B, waiting) / ms * 1e3
                        if rate > best[0]:
                            best = (rate, d, w)
                got = cost.plan_rows(B, ctx=ctx, max_depth=6, max_width=PLAN_WIDTHS, calibration=cal,
                                     rows_waiting=waiting)
                assert got == want
                assert (got.tokens_per_s, got.depth, got.width if got.depth else 1) == best


def test_plan_for_batch_grows_on_a_flat_curve_and_falls_back_to_ar_when_tokens_cost():
    flat = CostModel(linear_tm(10.0, 0.0))
    for B in (1, 4, 16):
        p = flat.plan_for_batch(B, ctx=64, max_depth=5, continuation=[0.8] * 5)
        assert (p.depth, p.budget) == (5, 5) and p.tokens_per_s > p.ar_tokens_per_s
    # a fixed 4 ms plus 1 ms per token of the batch: a tree pays for one row, not for 16
    mixed = CostModel(linear_tm(4.0, 1.0))
    plans = {B: mixed.plan_for_batch(B, ctx=64, max_depth=5, continuation=[0.8] * 5) for B in (1, 4, 16)}
    assert plans[1].depth >= 2 and plans[16].depth == 0 and plans[16].budget == 0
    assert plans[1].depth >= plans[4].depth >= plans[16].depth
    assert plans[16].tokens_per_s == plans[16].ar_tokens_per_s
    # the plan's numbers are the formula's: E(2) = 1 + 0.8 + 0.64 at depth 2, and a static
    # batch's rate is its slowest row's, 2.44 - z_2 * ROW_SPREAD * 1.44 tokens (z_2 = 1 / sqrt(pi))
    flat_cm = CostModel(linear_tm(10.0, 0.0, draft=1e-3))
    p2 = flat_cm.plan_for_batch(2, ctx=64, max_depth=2, continuation=[0.8, 0.8])
    slowest = 2.44 - ROW_SPREAD * 1.44 / math.sqrt(math.pi)
    assert p2.expected_tokens == pytest.approx(2.44) and p2.tokens_per_s == pytest.approx(2 * slowest / p2.predicted_ms * 1e3)
    w2 = flat_cm.plan_for_batch(2, ctx=64, max_depth=2, continuation=[0.8, 0.8], rows_waiting=True)
    assert w2.tokens_per_s == pytest.approx(2 * 2.44 / w2.predicted_ms * 1e3)  # no row waits for the slowest


def test_a_static_batch_plans_for_its_slowest_row_so_trees_are_shallower_than_while_rows_wait():
    """Rows that draft deeper spread further apart (``slowest_row_tokens``): with a fixed
    6 ms plus 0.4 ms per token of the batch and a continuation of 0.6, 4 rows while prompts
    wait to join draft two levels (1.26x a plain step); a static batch of 4 drafts one
    (1.16x for its slowest row); for one row, waiting changes nothing."""
    m = CostModel(linear_tm(6.0, 0.4))
    waiting = m.plan_for_batch(4, ctx=64, max_depth=4, continuation=[0.6] * 4, rows_waiting=True)
    static = m.plan_for_batch(4, ctx=64, max_depth=4, continuation=[0.6] * 4)
    assert (waiting.depth, static.depth) == (2, 1)
    assert waiting.tokens_per_s / waiting.ar_tokens_per_s == pytest.approx(1.262, abs=1e-3)
    assert static.tokens_per_s / static.ar_tokens_per_s == pytest.approx(1.157, abs=1e-3)
    assert static.expected_tokens == pytest.approx(1.6)  # the average row's, as before
    one = [m.plan_for_batch(1, ctx=64, max_depth=4, continuation=[0.6] * 4, rows_waiting=w) for w in (False, True)]
    assert one[0] == one[1]


def test_plan_for_batch_reads_the_prior_calibration_and_checks_its_input():
    cal = Calibration()
    cal.cont_trials[:3], cal.cont_accepts[:3] = [100.0] * 3, [0.0] * 3  # the walk never went on
    never = CostModel(linear_tm(10.0, 0.0), cal).plan_for_batch(1, ctx=64, max_depth=3)
    assert never.depth == 0
    assert CostModel(linear_tm(10.0, 0.0)).plan_for_batch(1, ctx=64, max_depth=3).depth == 3  # prior 0.5
    m = CostModel(linear_tm(10.0, 0.0))
    for kw, match in ((dict(batch=0), "batch=0"), (dict(batch=True), "batch=True"),
                      (dict(max_depth=-1), "max_depth"), (dict(width=0), "width"),
                      (dict(continuation=[0.5]), "continuation"), (dict(continuation=[2.0] * 3), "continuation")):
        args = dict(batch=2, ctx=64, max_depth=3) | kw
        with pytest.raises(ValueError, match=match):
            m.plan_for_batch(args.pop("batch"), **args)


def test_needed_continuation_is_the_smallest_rate_that_reaches_the_speedup():
    mixed = CostModel(linear_tm(4.0, 1.0))
    c1, d1 = mixed.needed_continuation(1, 1.3, ctx=64, max_depth=5)
    p = mixed.plan_for_batch(1, ctx=64, max_depth=5, continuation=[c1] * 5)
    assert p.depth == d1 >= 1 and p.tokens_per_s >= 1.3 * p.ar_tokens_per_s
    below = mixed.plan_for_batch(1, ctx=64, max_depth=5, continuation=[c1 - 0.01] * 5)
    assert below.tokens_per_s < 1.3 * below.ar_tokens_per_s  # one grid step less does not reach it
    # more rows make tokens dearer: a higher rate is needed, and at 16 rows none suffices for 2x
    c4, _ = mixed.needed_continuation(4, 1.3, ctx=64, max_depth=5)
    assert c4 > c1
    assert mixed.needed_continuation(16, 2.0, ctx=64, max_depth=5) is None
    assert mixed.needed_continuation(4, 1.0, ctx=64, max_depth=5) == (0.0, 0)  # plain steps already do 1x
    for kw, match in ((dict(speedup=0), "speedup=0"), (dict(step=0.0), "step=0.0"), (dict(step=1), "step=1")):
        args = dict(speedup=1.3, ctx=64, max_depth=3) | kw
        with pytest.raises(ValueError, match=match):
            mixed.needed_continuation(1, **args)


def test_measured_batch_draft_and_bookkeeping_replace_the_model():
    modelled = grid_tm()
    assert modelled.overhead_batch(4) == 4 * modelled.overhead_ms  # per row, not measured
    t = grid_tm(batch_draft_ms=(2.0, 5.0), batch_draft_width=2.0, batch_overhead_ms=(1.5, 3.0),
                batch_ar_overhead_ms=(0.5, 1.0))
    assert t.overhead_batch(4) == 3.0 and t.overhead_batch(2) == pytest.approx(2.0)
    assert t.overhead_batch(1) == t.overhead_ms and t.draft_batch(1, 2) == t.draft(2)
    # at 4 rows: the measured call (mean width 2); a wider frontier adds the batch-1 slope from 4 x 2 to
    # 4 x 3 frontier rows (c_d(w) = 2 + 0.5 (w - 1): c_d(8) = 5.5, c_d(12) = 7.5); a narrower one costs
    # the measured call (the slope would price it at 5.0 + 3.5 - 5.5 = 3.0)
    assert t.draft_batch(4, 2) == pytest.approx(5.0) and t.draft_batch(4, 3) == pytest.approx(5.0 + 7.5 - 5.5)
    assert t.draft_batch(4, 1) == pytest.approx(5.0)
    # a batch-1 curve that falls with the width (its one-node calls are each step's first, which
    # take the accepted tokens in) prices no narrower frontier above the measured call, however
    # far past its widest point the batch's frontier rows go
    falling = grid_tm(draft_widths=(1, 3), draft_ms=(1.9, 1.2), batch_draft_ms=(2.0, 2.6), batch_draft_width=8 / 3,
                      batch_overhead_ms=(1.5, 3.0), batch_ar_overhead_ms=(0.5, 1.0))
    assert falling.draft_batch(4, 1) == pytest.approx(2.6) and falling.draft_batch(4, 2) == pytest.approx(2.6)
    assert falling.draft_batch(4, 3) == pytest.approx(2.6)  # wider, but the curve falls: no more
    assert t.ar_step_batch(4, 100) == pytest.approx(14.0 + 1.0)
    assert Timings.from_dict(t.to_dict()) == t
    with pytest.raises(ValueError, match="one latency per batch size"):
        grid_tm(batch_draft_ms=(1.0,), batch_overhead_ms=(1.0,), batch_ar_overhead_ms=(1.0,))
    with pytest.raises(ValueError, match="batch_draft_width"):
        grid_tm(batch_draft_width=0.5)


def test_bookkeeping_grows_with_the_drafted_depth():
    """``tree_overhead(B, D)``: one row pays c_o at one depth plus the per-depth cost for
    each further depth; several rows the same with their own measurements by depth, or
    (older records) their fixed-tree bookkeeping at every depth, or B rows' worth of the
    one-row price without measurements."""
    flat = tm()
    assert flat.tree_overhead(1, 5) == flat.overhead_ms  # records before it: one c_o
    t = tm(overhead_depth_ms=0.8)
    assert t.tree_overhead(1, 1) == 1.5 and t.tree_overhead(1, 0) == 1.5
    assert t.tree_overhead(1, 3) == pytest.approx(1.5 + 2 * 0.8)
    assert grid_tm(overhead_depth_ms=0.8).tree_overhead(4, 3) == pytest.approx(4 * (1.5 + 2 * 0.8))
    g = grid_tm(overhead_depth_ms=0.8, batch_draft_ms=(2.0, 5.0), batch_overhead_ms=(1.5, 3.0),
                batch_ar_overhead_ms=(0.5, 1.0))
    assert g.tree_overhead(4, 1) == g.tree_overhead(4, 6) == 3.0
    assert g.tree_overhead(2, 3) == pytest.approx(2.0)  # interpolated between 1 and 4 rows
    assert Timings.from_dict(g.to_dict()) == g
    old = t.to_dict()
    del old["overhead_depth_ms"]
    assert Timings.from_dict(old) == tm()
    with pytest.raises(ValueError, match=">= 0"):
        tm(overhead_depth_ms=-0.1)
    # measured by depth at every batch size: 1 row 1.5 + 0.8 a depth, 4 rows 3.0 + 1.2 a depth
    d = grid_tm(overhead_depth_ms=0.8, batch_draft_ms=(2.0, 5.0), batch_overhead_ms=(1.5, 3.0),
                batch_overhead_depth_ms=(0.8, 1.2), batch_ar_overhead_ms=(0.5, 1.0))
    assert d.tree_overhead(4, 1) == 3.0 and d.tree_overhead(4, 3) == pytest.approx(3.0 + 2 * 1.2)
    assert d.tree_overhead(2, 2) == pytest.approx(2.0 + (0.8 + 0.4 / 3))  # both interpolated in B
    assert d.tree_overhead(1, 3) == t.tree_overhead(1, 3)  # one row: the one-row fields
    assert Timings.from_dict(d.to_dict()) == d
    with pytest.raises(ValueError, match="batch_overhead_depth_ms"):
        grid_tm(batch_draft_ms=(2.0, 5.0), batch_overhead_ms=(1.5, 3.0), batch_overhead_depth_ms=(0.8,),
                batch_ar_overhead_ms=(0.5, 1.0))
    with pytest.raises(ValueError, match=">= 0"):
        grid_tm(batch_draft_ms=(2.0, 5.0), batch_overhead_ms=(1.5, 3.0), batch_overhead_depth_ms=(0.8, -1.0),
                batch_ar_overhead_ms=(0.5, 1.0))



def test_the_batched_one_depth_price_grows_with_the_nodes_per_row():
    """With the one-node price measured (``batch_overhead_narrow_ms``), a several-row tree
    step's bookkeeping is linear in its nodes per row through that and the one-depth tree's
    (``batch_overhead_width`` nodes); the per-depth part and one row stay as they were."""
    kw = dict(overhead_depth_ms=0.8, batch_draft_ms=(2.0, 5.0), batch_overhead_ms=(1.5, 9.0),
              batch_overhead_depth_ms=(0.8, 3.0), batch_ar_overhead_ms=(0.5, 4.0))
    one = grid_tm(**kw)
    t = grid_tm(**kw, batch_overhead_narrow_ms=(1.5, 6.0), batch_overhead_width=3)
    assert t.tree_overhead(4, 1, width=1) == pytest.approx(6.0)
    assert t.tree_overhead(4, 1, width=2) == pytest.approx(7.5)
    assert t.tree_overhead(4, 1, width=3) == pytest.approx(9.0) == one.tree_overhead(4, 1, width=3)
    assert t.tree_overhead(4, 1, width=5) == pytest.approx(12.0)  # past the widest measured: the same line
    assert t.tree_overhead(4, 2, width=1) == pytest.approx(6.0 + 3.0)  # + one further depth
    assert t.tree_overhead(4, 1) == 9.0  # no width (the cost passes): the one-depth tree's price
    assert t.tree_overhead(2, 1, width=1) == pytest.approx(1.5 + 4.5 / 3)  # interpolated in B
    assert t.tree_overhead(1, 2, width=1) == one.tree_overhead(1, 2)  # one row: its own fields
    assert one.tree_overhead(4, 1, width=1) == 9.0  # records before it: one price at every width
    assert grid_tm(**kw, batch_overhead_narrow_ms=(1.5, 12.0), batch_overhead_width=3).tree_overhead(
        4, 1, width=10) == 0.0  # a narrow price above the wide one (noise) never goes below 0
    assert Timings.from_dict(t.to_dict()) == t
    assert t.one_row().batch_overhead_narrow_ms == () and t.one_row().batch_overhead_width == 0
    with pytest.raises(ValueError, match="batch_overhead_narrow_ms"):
        grid_tm(**kw, batch_overhead_narrow_ms=(6.0,), batch_overhead_width=3)
    with pytest.raises(ValueError, match="batch_overhead_width >= 2"):
        grid_tm(**kw, batch_overhead_narrow_ms=(1.5, 6.0), batch_overhead_width=1)
    with pytest.raises(ValueError, match=">= 0"):
        grid_tm(**kw, batch_overhead_narrow_ms=(1.5, -6.0), batch_overhead_width=3)


def test_plan_rows_drafts_a_narrow_tree_priced_by_its_own_bookkeeping():
    """At 4 rows, one node a row one depth deep: at the three-node price it loses to plain
    steps; priced by its own nodes it pays, and the plan drafts it, not the two-node tree
    that would pay at the one-node price (each width priced by its own nodes)."""
    kw = dict(batch_draft_ms=(2.0, 2.5), batch_overhead_ms=(1.5, 9.0), batch_overhead_depth_ms=(0.8, 3.0),
              batch_ar_overhead_ms=(0.5, 3.0))
    cal = Calibration()
    cal.width_trials[0] = [100.0, 100.0, 100.0]
    cal.width_accepts[0] = [60.0, 95.0, 99.0]  # two nodes would pay at one node's price, not at their own
    # a verify forward of 4 rows x 2 tokens 1 ms above one of 4 x 1 (an AMX-like flat curve)
    grid = dict(batch_sizes=(1, 4), batch_row_sizes=(1, 2), batch_verify=((10.0, 11.0), (14.0, 15.0)))
    flat = CostModel(tm(**grid, **kw))
    assert flat.plan_rows(4, ctx=100, max_depth=1, max_width=1, calibration=cal).depth == 0  # one node: plain
    narrow = CostModel(tm(**grid, **kw, batch_overhead_narrow_ms=(1.5, 3.5), batch_overhead_width=3))
    p = narrow.plan_rows(4, ctx=100, max_depth=1, max_width=3, calibration=cal)
    assert (p.depth, p.width, p.budget) == (1, 1, 1) and p.tokens_per_s > p.ar_tokens_per_s


# -- the walk's output projections -----------------------------------------------------------


def test_projection_choice_all_rows_when_cheaper():
    # bfloat16 SmolLM2 here: one row 4.3 ms, 8 rows 5.4 ms -> every row at once pays
    flat = ProjectionTimings((1, 8, 16), (4.3, 5.4, 6.6))
    assert flat.project_all(9, 5)
    assert not flat.project_all(5, 5) and not flat.project_all(1, 1)  # same rows either way
    # a projection whose cost grows with the rows (e.g. compute-bound): the lazy walk pays
    steep = ProjectionTimings((1, 8, 64), (1.0, 8.0, 64.0))
    assert not steep.project_all(9, 5)  # 9 > 5 + 1
    assert steep.project_all(6, 5)  # 6 <= 5 + 1
    # a batch's totals: each tree that can leave its path costs one single-row projection
    assert steep.project_all(12, 8, leaving=4) and not steep.project_all(12, 8, leaving=3)  # 12 <= 8 + 4
    assert not flat.project_all(9, 5, leaving=0)  # no tree leaves its path: the paths are all it reads
    assert ProjectionTimings.from_dict(flat.to_dict()) == flat
    with pytest.raises(ValueError, match="increasing"):
        ProjectionTimings((4, 1), (1.0, 2.0))
    with pytest.raises(ValueError, match="finite"):
        ProjectionTimings((1,), (float("nan"),))


def test_measure_projection_times_every_size_and_is_monotone():
    clock, calls = [0.0], []
    cost = {1: 4.0, 2: 3.0, 4: 5.0}  # ms; the dip at 2 rows is noise

    def project(h):
        calls.append(h.shape)
        clock[0] += cost[h.shape[0]] / 1e3

    pt = measure_projection(project, 8, sizes=(1, 2, 4), reps=3, timer=lambda: clock[0])
    assert pt.sizes == (1, 2, 4) and pt.ms == pytest.approx((4.0, 4.0, 5.0))
    assert len(calls) == 3 * 4 and {tuple(s) for s in calls} == {(1, 8), (2, 8), (4, 8)}
    with pytest.raises(ValueError, match="reps"):
        measure_projection(project, 8, reps=0)


def test_projection_timings_are_cached_per_shape(tmp_path, monkeypatch):
    monkeypatch.setenv("RHEOPLAN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr("rheoplan.costmodel._PROJECTION", {})
    calls = []
    head = torch.nn.Linear(8, 13, bias=False)

    def project(h):
        calls.append(h.shape[0])
        return head(h)

    pt = projection_timings(project, 13, 8)
    n = len(calls)
    assert n > 0 and pt.sizes[0] == 1
    assert projection_timings(project, 13, 8) is pt and len(calls) == n  # memo
    monkeypatch.setattr("rheoplan.costmodel._PROJECTION", {})
    assert projection_timings(project, 13, 8) == pt and len(calls) == n  # read from the disk cache
    monkeypatch.setattr("rheoplan.costmodel._PROJECTION", {})
    monkeypatch.setenv("RHEOPLAN_REMEASURE", "1")
    projection_timings(project, 13, 8)
    assert len(calls) == 2 * n  # measured again


def test_capped_calibration_keeps_rates_and_bounds_trials():
    cal = Calibration()
    cal.trials[0][3], cal.accepts[0][3] = 200.0, 50.0
    cal.trials[1][1], cal.accepts[1][1] = 10.0, 7.0
    cal.cont_trials[0], cal.cont_accepts[0] = 80.0, 60.0
    c = cal.capped(40)
    assert (c.trials[0][3], c.accepts[0][3]) == (40.0, 10.0)
    assert (c.trials[1][1], c.accepts[1][1]) == (10.0, 7.0)  # under the cap: as it was
    assert (c.cont_trials[0], c.cont_accepts[0]) == (40.0, 30.0)
    assert cal.trials[0][3] == 200.0  # a copy
    for bad in (0, -1.0, float("inf"), "40"):
        with pytest.raises(ValueError, match="max_trials"):
            cal.capped(bad)


def test_priors_file_round_trip_and_errors(tmp_path):
    from rheoplan.costmodel import load_priors, save_priors

    hot, cold = Calibration(), Calibration()
    hot.trials[0][9], hot.accepts[0][9] = 4.0, 1.0
    cold.trials[0][9], cold.accepts[0][9] = 4.0, 4.0
    f = save_priors(tmp_path / "calibration.json", {1.0: hot, 0.0: cold}, {"prompts": 2})
    assert load_priors(f) == {0.0: cold, 1.0: hot}
    with pytest.raises(ValueError, match="no such file"):
        load_priors(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="is empty"):
        save_priors(tmp_path / "x.json", {})
    for text, match in (("{", "not valid JSON"), ('{"format": "other"}', "not a rheoplan-calibration-priors"),
                        ('{"format": "rheoplan-calibration-priors/1", "temperatures": {}}', "no temperature"),
                        ('{"format": "rheoplan-calibration-priors/1", "temperatures": {"hot": {}}}', "not a number")):
        f.write_text(text)
        with pytest.raises(ValueError, match=match):
            load_priors(f)


def test_a_decode_starts_from_the_prior_of_the_nearest_temperature():
    hot, cold, mine = Calibration(), Calibration(), Calibration()
    hot.trials[0][0] = 1.0
    cold.trials[0][1] = 1.0
    mine.trials[0][2] = 1.0
    cm = CostModel(tm(), priors=((0.0, cold), (1.0, hot)))
    assert cm.prior_for(0.0) == (0.0, cold) and cm.prior_for(0.8) == (1.0, hot)
    assert cm.prior_for(0.5) == (0.0, cold)  # a tie goes to the lower temperature
    assert cm.fresh_calibration(1.3) == hot and cm.fresh_calibration(1.3) is not hot
    assert cm.fresh_calibration() == Calibration()  # no temperature: no prior
    explicit = CostModel(tm(), mine, priors=((1.0, hot),))  # an explicit calibration wins
    assert explicit.prior_for(1.0) == (None, mine) and explicit.fresh_calibration(1.0) == mine


def test_scale_compares_raw_predictions_with_what_was_accepted():
    from rheoplan.costmodel import SCALE_PRIOR, CostPlan, node_acceptance

    cal = Calibration()
    assert cal.scale() == 1.0
    cal.record_step(8.0, 4.0)  # planned with scale 1: 8 predicted, 4 accepted
    s1 = (4.0 + SCALE_PRIOR) / (8.0 + SCALE_PRIOR)
    assert cal.scale() == pytest.approx(s1)
    cal.record_step(8.0 * s1, 4.0)  # planned with the scale: the raw 8 is what is counted
    assert cal.predicted == pytest.approx(16.0) and cal.scale() == pytest.approx((8 + SCALE_PRIOR) / (16 + SCALE_PRIOR))
    for bad in ((-1.0, 0.0), (1.0, float("nan"))):
        with pytest.raises(ValueError, match="record_step"):
            cal.record_step(*bad)
    assert Calibration.from_dict(cal.to_dict()) == cal
    old = cal.to_dict()
    del old["predicted"], old["realized"]  # a file from before: no correction
    assert Calibration.from_dict(old).scale() == 1.0
    # node estimates shrink by the scale (the root stays 1)
    tgt = hashed_context_lm(6, seed=1, sharpness=1.0)
    t = plan_tree(functional_draft_fn(tgt, (0, 1)), [1], tree=TreeConfig(depth=2, frontier=2, slots=2, budget=4,
                                                                         support=6),
                  sampling=SamplingConfig(), prefix_len=[1])
    plain = CostPlan.from_calibration(tm(), Calibration())
    half = CostPlan.from_calibration(tm(), cal)
    a, b = node_acceptance(plain, t), node_acceptance(half, t)
    assert b[0] == 1.0 and torch.allclose(b[1:], (a[1:] * cal.scale()).clamp(max=1.0))
    # and so does the a-priori plan's expected length
    cm = CostModel(tm())
    full = cm.plan_for_batch(1, ctx=100, max_depth=2, continuation=[0.5, 0.5])
    assert cm.plan_for_batch(1, ctx=100, max_depth=2, continuation=[0.5, 0.5], scale=0.0).depth == 0
    assert full.depth == 0 or full.expected_tokens > 1.0
    with pytest.raises(ValueError, match="scale=-1"):
        cm.plan_for_batch(1, ctx=100, max_depth=2, continuation=[0.5, 0.5], scale=-1)


def test_batch_tree_scale_multiplies_the_grid_for_trees_only():
    grid = dict(batch_sizes=(1, 4), batch_row_sizes=(1, 2), batch_verify=((10.0, 12.0), (14.0, 22.0)))
    plain, scaled = tm(**grid), tm(**grid, batch_tree_scale=(1.0, 1.5))
    assert scaled.verify_batch(4, 1, 100) == plain.verify_batch(4, 1, 100)  # one token per row: as measured
    assert scaled.verify_batch(4, 2, 100) == pytest.approx(1.5 * 22.0)
    assert scaled.verify_batch(1, 2, 100) == plain.verify_batch(1, 2, 100)  # batch 1: its own curve
    assert Timings.from_dict(scaled.to_dict()) == scaled
    for bad in ((1.0,), (1.0, 0.0), (1.0, float("inf"))):
        with pytest.raises(ValueError, match="batch_tree_scale"):
            tm(**grid, batch_tree_scale=bad)


def test_batch_ar_scale_multiplies_the_grid_for_one_token_rows_only():
    """The plain step's anchor: a grid that prices 4 one-token rows high (38.5 ms where a
    real step ran in 35) made trees look better than they were against plain steps."""
    grid = dict(batch_sizes=(1, 4), batch_row_sizes=(1, 2), batch_verify=((10.0, 12.0), (14.0, 22.0)))
    plain, scaled = tm(**grid), tm(**grid, batch_ar_scale=(1.0, 0.5))
    assert scaled.verify_batch(4, 1, 100) == pytest.approx(plain.verify_batch(4, 1, 100) - 7.0)
    assert scaled.verify_batch(4, 2, 100) == plain.verify_batch(4, 2, 100)  # trees: batch_tree_scale's
    assert scaled.ar_step_batch(4, 100) == pytest.approx(plain.ar_step_batch(4, 100) - 7.0)
    assert scaled.verify_batch(1, 1, 100) == plain.verify_batch(1, 1, 100)  # batch 1: its own curve
    assert Timings.from_dict(json.loads(json.dumps(scaled.to_dict()))) == scaled  # as the cache keeps it
    for bad in ((1.0,), (1.0, -2.0), (1.0, float("nan"))):
        with pytest.raises(ValueError, match="batch_ar_scale"):
            tm(**grid, batch_ar_scale=bad)


def _work(lengths, groups, overhead):
    return sum(overhead + len(g) * max(lengths[i] for i in g) for g in groups)


def _set_partitions(items):
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in _set_partitions(rest):
        for k in range(len(part)):
            yield part[:k] + [[first] + part[k]] + part[k + 1:]
        yield [[first]] + part


def test_prefill_groups_is_the_cheapest_partition_of_the_rows():
    """Against every partition of up to 7 rows (not only those of neighbouring lengths):
    the groups cover every row once and cost the least padded tokens plus forwards."""
    rng = random.Random(0)
    for _ in range(60):
        n = rng.randint(1, 7)
        lengths = [rng.randint(1, 120) for _ in range(n)]
        overhead = rng.choice([0.0, 5.0, 46.0, 300.0])
        groups = prefill_groups(lengths, overhead)
        assert sorted(i for g in groups for i in g) == list(range(n))
        best = min(_work(lengths, p, overhead) for p in _set_partitions(list(range(n))))
        assert _work(lengths, groups, overhead) == pytest.approx(best)
        for g in groups:  # shortest first within a group
            assert [lengths[i] for i in g] == sorted(lengths[i] for i in g)


def test_prefill_groups_examples_and_edges():
    assert prefill_groups([40, 100, 44, 96], 46) == [[0, 2], [3, 1]]
    assert prefill_groups([40, 100, 44, 96], float("inf")) == [[0, 2, 3, 1]]  # no slope measured
    assert prefill_groups([40, 100, 44, 96], 1000) == [[0, 2, 3, 1]]  # forwards dear: one
    assert prefill_groups([], 46) == [] and prefill_groups([7], 46) == [[0]]
    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="overhead_tokens"):
            prefill_groups([3, 4], bad)


def test_forward_overhead_tokens_is_the_fixed_cost_over_the_slope():
    t = tm(sizes=(1, 32, 64), verify_lo=(18.8, 28.7, 41.7), verify_hi=(20.0, 30.0, 45.0))
    assert t.forward_overhead_tokens() == pytest.approx(18.8 / (13.0 / 32))
    flat = tm(sizes=(1, 32, 64), verify_lo=(18.8, 28.7, 28.7), verify_hi=(20.0, 30.0, 45.0))
    assert flat.forward_overhead_tokens() == float("inf")
    assert tm(sizes=(1,), verify_lo=(3.0,), verify_hi=(4.0,)).forward_overhead_tokens() == float("inf")


def test_verify_growth_is_the_largest_trees_price_over_one_tokens_at_the_steeper_context():
    t = tm(sizes=(1, 32, 64), verify_lo=(20.0, 40.0, 60.0), verify_hi=(25.0, 50.0, 100.0))
    assert t.verify_growth() == (64, pytest.approx(4.0))  # ctx_hi: 100 / 25, steeper than 60 / 20
    t = tm(sizes=(1, 64), verify_lo=(10.0, 11.0), verify_hi=(10.0, 10.5))
    assert t.verify_growth() == (64, pytest.approx(1.1))
    assert tm(sizes=(1,), verify_lo=(3.0,), verify_hi=(4.0,)).verify_growth() == (1, 1.0)


def test_with_verify_of_takes_the_reference_curve_and_keeps_the_rest():
    own = tm(sizes=(1, 2), verify_lo=(34.0, 35.0), verify_hi=(36.0, 37.0))
    ref = Timings((1, 16), (20.0, 30.0), (25.0, 40.0), 8, 1024, (1,), (9.0,), 9.0, 9.0)
    out = own.with_verify_of(ref)
    assert (out.sizes, out.verify_lo, out.verify_hi, out.ctx_lo, out.ctx_hi) == \
        ((1, 16), (20.0, 30.0), (25.0, 40.0), 8, 1024)
    assert out == replace(own, sizes=(1, 16), verify_lo=(20.0, 30.0), verify_hi=(25.0, 40.0), ctx_lo=8, ctx_hi=1024)
