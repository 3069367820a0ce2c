"""Measuring at load: the dtype pick and the cost model's latencies, with injected clocks."""

from __future__ import annotations

import io
import json

import pytest
import torch

from _decode_models import tiny_llama
from rheoplan import probe
from rheoplan.config import TreeConfig
from rheoplan.costmodel import Timings
from rheoplan.models import _hf_common
from rheoplan.models.eagle3.head import Eagle3Config, Eagle3Head
from rheoplan.models.packed_linear import PackedLinear, pack_linears, packing_available


class Clock:
    """A fake clock: candidates advance it by what they are meant to cost."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def spend(self, ms: float):
        def fn():
            self.now += ms / 1e3
        return fn


def test_fastest_picks_the_lowest_median_and_ties_go_first():
    c = Clock()
    best, ms = probe.fastest({"a": c.spend(3.0), "b": c.spend(2.0), "c": c.spend(2.0)}, reps=3, timer=c)
    assert best == "b" and ms == pytest.approx({"a": 3.0, "b": 2.0, "c": 2.0})
    with pytest.raises(ValueError, match="at least one candidate"):
        probe.fastest({}, timer=c)


def _recorded_calls(c: Clock, order: list):
    """``call(name, ms)``: a call that records its name in ``order`` and advances ``c`` by ``ms``."""
    def call(name, ms):
        def fn():
            order.append(name)
            c.now += ms / 1e3
        return fn
    return call


def test_round_robin_times_one_call_of_each_per_round():
    c, order = Clock(), []
    call = _recorded_calls(c, order)
    ms = probe.round_robin_ms([call("a", 1.0), call("b", 4.0)], reps=2, warmup=1, timer=c)
    assert ms == pytest.approx([1.0, 4.0]) and order == ["a", "b", "a", "b", "a", "b"]
    with pytest.raises(ValueError, match="reps=0"):
        probe.round_robin_ms([call("a", 1.0)], reps=0, timer=c)


def test_round_robin_runs_before_untimed_ahead_of_every_call():
    c, order = Clock(), []
    call = _recorded_calls(c, order)
    ms = probe.round_robin_ms([call("a", 1.0), call("b", 4.0)], reps=2, warmup=1, timer=c, before=call("-", 50.0))
    assert ms == pytest.approx([1.0, 4.0])  # the 50 ms before each call are not timed
    assert order == ["-", "a", "-", "b"] * 3


def test_chain_verify_times_each_forward_after_an_output_projection(monkeypatch, tmp_path):
    model = tiny_llama(seed=1, vocab=16)
    # the target adapter measures its output projection once per process and machine
    # (costmodel.projection_timings): do it before recording, in a cache of this test's own,
    # so the recorded order does not depend on what an earlier run left in ~/.cache
    monkeypatch.setenv("RHEOPLAN_CACHE_DIR", str(tmp_path))
    probe.chain_verify_ms(model, 4, (1,), reps=1, warmup=0)
    seen = []  # the order of lm_head projections and verify forwards
    model.lm_head.register_forward_hook(lambda m, i, o: seen.append(("proj", tuple(i[0].shape))))
    real = model.model.forward

    def counting(*a, **kw):
        seen.append(("fwd", tuple(kw["input_ids"].shape)))
        return real(*a, **kw)

    model.model.forward = counting
    probe.chain_verify_ms(model, 4, (1, 3), reps=2, warmup=1)
    timed = seen[seen.index(("fwd", (1, 4))) + 1:]  # after the prompt's forward (4 cached tokens)
    hidden = model.config.hidden_size
    assert timed == [("proj", (1, hidden)), ("fwd", (1, 1)), ("proj", (1, hidden)), ("fwd", (1, 3))] * 3
    assert probe.output_projection_gap(torch.nn.Linear(2, 2)) is None  # no output embeddings: no gap


def test_fastest_uses_the_median_not_one_lucky_call():
    c = Clock()
    costs = iter([9.0, 1.0, 9.0, 9.0, 9.0])  # warm-up, then one lucky 1 ms call among 9 ms ones

    def noisy():
        c.now += next(costs) / 1e3

    best, ms = probe.fastest({"noisy": noisy, "steady": c.spend(5.0)}, reps=4, timer=c)
    assert best == "steady" and ms["noisy"] == pytest.approx(9.0)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RHEOPLAN_CACHE_DIR", str(tmp_path))
    return tmp_path


def _fake_forwards(clock, cost_by_dtype, seen, packed=None):
    """``probe._forward`` on a fake clock: ``cost_by_dtype[dtype]`` is one cost for every
    forward or ``{tokens: cost}``."""
    def fake(model, prompt_len, tokens):
        dt = next(model.parameters()).dtype
        seen.append(dt)
        if packed is not None:
            packed[dt] = any(isinstance(m, PackedLinear) for m in model.modules())
        cost = cost_by_dtype[dt]
        return clock.spend(cost[tokens] if isinstance(cost, dict) else cost)
    return fake


@pytest.mark.parametrize("costs,want", [
    ({torch.float32: 5.0, torch.bfloat16: 3.0}, torch.bfloat16),
    ({torch.float32: 5.0, torch.bfloat16: 8.0}, torch.float32),
])
def test_choose_dtype_measures_caches_and_reads_back(cache, monkeypatch, costs, want):
    model = tiny_llama()
    clock, seen = Clock(), []
    monkeypatch.setattr(probe, "_forward", _fake_forwards(clock, costs, seen))
    log = io.StringIO()
    dt, ms = probe.choose_dtype(model, model_id="tiny", timer=clock, log=log)
    assert dt is want and set(seen) == {torch.float32, torch.bfloat16}
    assert ms == {str(d).removeprefix("torch."): [pytest.approx(c), pytest.approx(c)] for d, c in costs.items()}
    assert f"dtype auto: {str(want).removeprefix('torch.')}" in log.getvalue()
    assert next(model.parameters()).dtype is torch.float32  # the caller's model is not cast
    assert not any(isinstance(m, PackedLinear) for m in model.modules())  # nor left packed
    rec = json.loads((cache / probe.DTYPE_CACHE).read_text())
    (key, val), = rec.items()
    assert "tiny" in key and "torch " in key and set(val["ms"]) == {"float32", "bfloat16"}
    seen.clear()
    dt2, _ = probe.choose_dtype(model, model_id="tiny", timer=clock, log=log)
    assert dt2 is want and seen == []  # cached: nothing measured again
    assert "(cached" in log.getvalue()
    seen.clear()
    probe.choose_dtype(model, model_id="another model", timer=clock, log=log)
    assert seen  # the key names the model
    seen.clear()
    monkeypatch.setenv("RHEOPLAN_REMEASURE", "1")
    probe.choose_dtype(model, model_id="tiny", timer=clock, log=log)
    assert seen  # asked to measure again


def _timed_dtypes(monkeypatch, one_and_tree):
    """A tiny model, a fake clock on which each dtype's 1-token and ``PROBE_TREE``-token
    forwards cost ``one_and_tree[dtype]`` ms, the list of dtypes timed and a log."""
    clock, seen = Clock(), []
    costs = {dt: {1: one, probe.PROBE_TREE: tree} for dt, (one, tree) in one_and_tree.items()}
    monkeypatch.setattr(probe, "_forward", _fake_forwards(clock, costs, seen))
    return tiny_llama(), clock, seen, io.StringIO()


def test_choose_dtype_picks_by_the_forward_the_decoding_runs(cache, monkeypatch):
    # this machine's shape (an AMX-exposing Xeon): float32 is faster for one token,
    # bfloat16 for a verify tree
    model, clock, seen, log = _timed_dtypes(monkeypatch, {torch.float32: (51.0, 78.0), torch.bfloat16: (61.0, 63.0)})
    dt, ms = probe.choose_dtype(model, model_id="tiny", pick_by="tree", timer=clock, log=log)
    assert dt is torch.bfloat16
    assert ms["float32"] == [pytest.approx(51.0), pytest.approx(78.0)]
    assert ms["bfloat16"] == [pytest.approx(61.0), pytest.approx(63.0)]
    assert "by the 9-token verify forward" in log.getvalue()
    seen.clear()
    dt, _ = probe.choose_dtype(model, model_id="tiny", pick_by="one", timer=clock, log=log)
    assert dt is torch.float32 and seen == []  # the same cached times, the other forward decides
    assert "by the 1-token forward" in log.getvalue()
    with pytest.raises(ValueError, match="pick_by='both'.*allowed"):
        probe.choose_dtype(model, model_id="tiny", pick_by="both", timer=clock, log=log)


def test_choose_dtype_breaks_a_tie_by_both_forwards(cache, monkeypatch):
    # the AVX2-only AMD EPYC in a slow spell: the 9-token forwards within the noise of each
    # other, bfloat16 clearly faster for one token
    model, clock, _, log = _timed_dtypes(monkeypatch, {torch.float32: (50.4, 72.0), torch.bfloat16: (43.5, 72.9)})
    dt, _ = probe.choose_dtype(model, model_id="tiny", pick_by="tree", timer=clock, log=log)
    assert dt is torch.bfloat16
    assert "within 1.05x of each other there, so by the sum of both forwards" in log.getvalue()


@pytest.mark.parametrize("ms,pick_by,want", [
    # beyond the margin the deciding forward decides, whatever the sum says
    ({"float32": [80.0, 70.0], "bfloat16": [40.0, 80.0]}, "tree", ("float32", False)),
    ({"float32": [80.0, 70.0], "bfloat16": [40.0, 73.4]}, "tree", ("bfloat16", True)),
    ({"float32": [40.0, 90.0], "bfloat16": [41.9, 60.0]}, "one", ("bfloat16", True)),
    ({"float32": [40.0, 90.0], "bfloat16": [42.1, 60.0]}, "one", ("float32", False)),
    # an exact tie everywhere: the first listed
    ({"float32": [50.0, 70.0], "bfloat16": [50.0, 70.0]}, "tree", ("float32", True)),
])
def test_pick_dtype_ties_within_the_margin_only(ms, pick_by, want):
    assert probe.pick_dtype(ms, pick_by) == want


def test_pick_dtype_rejects_bad_input():
    with pytest.raises(ValueError, match="pick_by='sum'.*allowed"):
        probe.pick_dtype({"float32": [1.0, 2.0]}, "sum")
    with pytest.raises(ValueError, match="ms holds no dtype"):
        probe.pick_dtype({})


def test_choose_dtype_measures_again_over_a_record_without_both_forwards(cache, monkeypatch):
    model = tiny_llama()
    clock, seen = Clock(), []
    monkeypatch.setattr(probe, "_forward", _fake_forwards(clock, {torch.float32: 5.0, torch.bfloat16: 3.0}, seen))
    probe.choose_dtype(model, model_id="tiny", timer=clock, log=io.StringIO())
    path = cache / probe.DTYPE_CACHE
    rec = json.loads(path.read_text())
    (key, _), = rec.items()
    path.write_text(json.dumps({key: {"dtype": "float32", "ms": {"float32": 8.0, "bfloat16": 6.0}}}))
    seen.clear()
    dt, ms = probe.choose_dtype(model, model_id="tiny", timer=clock, log=io.StringIO())
    assert seen and dt is torch.bfloat16 and ms["float32"] == [pytest.approx(5.0)] * 2


def test_choose_dtype_times_real_forwards_of_both_sizes(cache):
    model = tiny_llama()
    dt, ms = probe.choose_dtype(model, model_id="tiny", reps=2, prompt_len=8, use_cache=False, log=io.StringIO())
    assert dt in (torch.float32, torch.bfloat16) and set(ms) == {"float32", "bfloat16"}
    assert all(len(v) == 2 and min(v) > 0 for v in ms.values())
    assert not (cache / probe.DTYPE_CACHE).exists()  # use_cache=False writes nothing


@pytest.mark.parametrize("pays", [True, False])
def test_choose_dtype_times_every_dtype_packed_where_packing_pays(cache, monkeypatch, pays):
    model = tiny_llama()
    clock, seen, packed = Clock(), [], {}
    monkeypatch.setattr(probe, "_forward", _fake_forwards(clock, {torch.float32: 5.0, torch.bfloat16: 3.0},
                                                          seen, packed))
    monkeypatch.setattr(probe, "pack_where_it_pays", lambda m: (pack_linears(m) if pays else 0, pays, None))
    probe.choose_dtype(model, model_id="tiny", timer=clock, log=io.StringIO())
    # the loader runs them so, where this CPU can pack the dtype at all (oneDNN cannot pack
    # bfloat16 without AVX-512 or AVX-NE-CONVERT)
    assert packed == {dt: pays and packing_available(dt, "cpu") for dt in (torch.float32, torch.bfloat16)}
    assert not any(isinstance(m, PackedLinear) for m in model.modules())  # the caller's comes back plain


def tiny_head() -> Eagle3Head:
    cfg = Eagle3Config(vocab_size=50, draft_vocab_size=20, hidden_size=32, intermediate_size=64,
                       num_attention_heads=4, num_key_value_heads=2)
    return Eagle3Head(cfg).eval()


def _fake_head_steps(clock, cost_by_dtype, seen):
    def fake(head, rows):
        dt = next(head.parameters()).dtype
        seen.append(dt)
        return clock.spend(cost_by_dtype[dt])
    return fake


@pytest.mark.parametrize("costs,want", [
    ({torch.float32: 6.0, torch.bfloat16: 1.5}, torch.bfloat16),   # 4x faster: taken
    ({torch.float32: 6.0, torch.bfloat16: 5.5}, torch.bfloat16),   # 1.09x: past the margin
    ({torch.float32: 6.0, torch.bfloat16: 5.8}, torch.float32),    # 1.03x: a tie keeps float32
    ({torch.float32: 6.0, torch.bfloat16: 9.0}, torch.float32),
])
def test_choose_head_dtype_needs_the_margin_and_caches(cache, monkeypatch, costs, want):
    head = tiny_head()
    clock, seen = Clock(), []
    monkeypatch.setattr(probe, "_head_step", _fake_head_steps(clock, costs, seen))
    log = io.StringIO()
    dt, ms = probe.choose_head_dtype(head, head_id="tiny head", timer=clock, log=log)
    assert dt is want and set(seen) == {torch.float32, torch.bfloat16}
    assert ms == pytest.approx({str(k).removeprefix("torch."): v for k, v in costs.items()})
    assert next(head.parameters()).dtype is torch.float32  # the caller's head is not cast
    seen.clear()
    assert probe.choose_head_dtype(head, head_id="tiny head", timer=clock, log=log)[0] is want
    assert seen == [] and "(cached" in log.getvalue()
    probe.choose_head_dtype(head, head_id="another head", timer=clock, log=log)
    assert seen  # the key names the head


def test_choose_head_dtype_times_each_step_after_the_targets_projection(cache, monkeypatch):
    clock, order = Clock(), []
    monkeypatch.setattr(probe, "_head_step", lambda head, rows: lambda: order.append(
        str(next(head.parameters()).dtype)))
    monkeypatch.setattr(probe, "output_projection_gap", lambda model: lambda: order.append("gap"))
    log = io.StringIO()
    probe.choose_head_dtype(tiny_head(), head_id="tiny head", target=tiny_llama(), reps=2, timer=clock, log=log)
    assert order == ["gap", "torch.float32", "gap", "torch.bfloat16"] * 3  # a warm-up round, then reps
    assert "after the target's output projection" in log.getvalue()
    order.clear()  # timed without the gap, the record is another one: measured again
    probe.choose_head_dtype(tiny_head(), head_id="tiny head", reps=2, timer=clock, log=log)
    assert order == ["torch.float32", "torch.bfloat16"] * 3


def test_head_step_makes_a_root_call_and_a_call_of_the_nodes():
    head = tiny_head()
    calls = []
    head.register_forward_hook(lambda mod, args, out: calls.append(
        (tuple(args[1].shape), tuple(args[3][0].shape), tuple(args[4].shape), tuple(out[0].shape))))
    probe._head_step(head, 3, context=10)()
    # the root call fuses two pairs of target features (3 x 32 wide) over 10 cached pairs;
    # the three nodes read the root's hidden and see the cache, the pairs and themselves
    assert calls == [((2, 96), (2, 10, 8), (2, 12), (2, 32)), ((3, 32), (2, 12, 8), (3, 15), (3, 32))]


def test_choose_head_dtype_refuses_bad_arguments():
    head = tiny_head()
    with pytest.raises(TypeError, match="head is a Sequential: allowed an Eagle3Head"):
        probe._head_step(torch.nn.Sequential(torch.nn.Linear(8, 16)), 3)
    with pytest.raises(TypeError, match="head is a Sequential: allowed an Eagle3Head"):
        probe.choose_head_dtype(torch.nn.Sequential(torch.nn.Linear(8, 16)), head_id="x")
    with pytest.raises(ValueError, match="margin=0.5 is out of range"):
        probe.choose_head_dtype(head, head_id="x", margin=0.5)
    with pytest.raises(ValueError, match="rows=0 is out of range"):
        probe.choose_head_dtype(head, head_id="x", rows=0)


def test_chain_linear_shapes():
    for n in (1, 2, 5):
        lin = probe.chain_linear(3, 10, n)
        assert int(lin.n[0]) == n and lin.position[0, :n].tolist() == list(range(10, 10 + n))


def test_measure_timings_on_a_tiny_model_and_cache(cache, monkeypatch):
    model, draft = tiny_llama(seed=1, vocab=16), tiny_llama(seed=2, vocab=16)
    tree = TreeConfig(depth=2, frontier=2, slots=2, budget=4, rheostat=1, support=8)
    log = io.StringIO()
    decoded = []  # (rows, tree depth, budget) of each decode the probe runs
    real = probe.plan_and_decode

    def recording(model, draft, ids, **kw):
        t = kw.get("tree")
        decoded.append((len(ids) if isinstance(ids[0], list) else 1, t and t.depth, t and t.budget))
        return real(model, draft, ids, **kw)

    monkeypatch.setattr(probe, "plan_and_decode", recording)
    tm = probe.measure_timings(model, draft, [1, 2, 3], tree=tree, ctx=(4, 12), sizes=(1, 2, 4),
                               reps=1, steps=6, model_id="tiny", log=log)
    # one row decodes the fixed tree and the same tree cut to one depth (budget: its slots)
    assert (1, 2, 4) in decoded and (1, 1, 2) in decoded
    assert isinstance(tm, Timings) and tm.sizes == (1, 2, 4) and (tm.ctx_lo, tm.ctx_hi) == (4, 12)
    assert all(v > 0 for v in tm.verify_lo + tm.verify_hi + tm.draft_ms)
    assert set(tm.draft_widths) <= {1, 2} and tm.overhead_ms >= 0 and tm.ar_overhead_ms >= 0
    assert (tm.batch_sizes, tm.batch_row_sizes) == (probe.BATCH_SIZES, probe.BATCH_ROW_SIZES)
    # the batched steps are measured where plan_and_decode takes a list of prompts
    measured = probe.batched_decode_unavailable() is None
    assert len(tm.batch_overhead_ms) == (len(tm.batch_sizes) if measured else 0)
    assert len(tm.batch_verify) == len(tm.batch_sizes) and tm.verify_batch(16, 2, 4) > 0
    assert "measured" in log.getvalue() and "batched verify" in log.getvalue()
    again = probe.measure_timings(model, draft, [1, 2, 3], tree=tree, ctx=(4, 12), sizes=(1, 2, 4),
                                  reps=1, steps=6, model_id="tiny", log=log)
    assert again == tm and "cached" in log.getvalue()


def test_cached_only_reads_a_record_and_measures_nothing(cache, monkeypatch):
    """``cached_only``: the record of exactly these settings or None, and no measurement
    either way; a one-row record (``batch_sizes=()``) is not the full one's."""
    model, draft = tiny_llama(seed=1, vocab=16), tiny_llama(seed=2, vocab=16)
    tree = TreeConfig(depth=2, frontier=2, slots=2, budget=4, rheostat=1, support=8)
    kw = dict(tree=tree, ctx=(4, 12), sizes=(1, 2), reps=1, steps=4, model_id="tiny", log=io.StringIO())
    decodes = []
    real = probe.plan_and_decode

    def recording(m, *a, **k):
        if m is model:  # (the cache key's check that batched decoding works decodes a functional model)
            decodes.append(1)
        return real(m, *a, **k)

    monkeypatch.setattr(probe, "plan_and_decode", recording)
    assert probe.measure_timings(model, draft, [1, 2, 3], cached_only=True, **kw) is None
    assert probe.measure_timings(model, draft, [1, 2, 3], cached_only=True, batch_sizes=(), **kw) is None
    assert decodes == []  # nothing measured
    one = probe.measure_timings(model, draft, [1, 2, 3], batch_sizes=(), **kw)
    assert one.batch_sizes == () and one.batch_verify == () and len(decodes) == 3  # one row's decodes only
    assert probe.measure_timings(model, draft, [1, 2, 3], cached_only=True, batch_sizes=(), **kw) == one
    assert probe.measure_timings(model, draft, [1, 2, 3], cached_only=True, **kw) is None  # not the full record
    full = probe.measure_timings(model, draft, [1, 2, 3], **kw)  # a batched measurement ...
    assert full.batch_sizes == probe.BATCH_SIZES and full.one_row() != one
    # ... is also the newest record of one row: its one-row part, every batched price dropped
    assert probe.measure_timings(model, draft, [1, 2, 3], cached_only=True, batch_sizes=(), **kw) == full.one_row()
    assert full.one_row().batch_verify == () and full.one_row().verify_lo == full.verify_lo
    assert probe.measure_timings(model, draft, [1, 2, 3], cached_only=True, **kw) == full
    monkeypatch.setenv("RHEOPLAN_REMEASURE", "1")  # asked to measure again: nothing cached counts
    assert probe.measure_timings(model, draft, [1, 2, 3], cached_only=True, batch_sizes=(), **kw) is None


def test_a_dipping_verify_curve_is_timed_again_and_each_size_keeps_its_faster_median(cache, monkeypatch):
    """A curve that dips (a busy spell) is measured once more and each size keeps the lower
    of its two medians; a clean curve is measured once; a dip that survives still warns."""
    model, draft = tiny_llama(seed=1, vocab=16), tiny_llama(seed=2, vocab=16)
    tree = TreeConfig(depth=2, frontier=2, slots=2, budget=4, rheostat=1, support=8)
    curves = {4: [[20.0, 15.0, 16.0], [12.0, 13.0, 17.0]],  # dips, then a quiet retake
              12: [[30.0, 31.0, 33.0]],                     # clean: timed once
              }
    calls = []

    def fake(model, ctx, sizes, **kw):
        calls.append(ctx)
        return curves[ctx].pop(0)

    monkeypatch.setattr(probe, "chain_verify_ms", fake)
    log = io.StringIO()
    tm = probe.measure_timings(model, draft, [1, 2, 3], tree=tree, ctx=(4, 12), sizes=(1, 2, 4), reps=1,
                               steps=4, model_id="tiny", batch_sizes=(), log=log)
    assert calls == [4, 4, 12]
    assert tm.verify_lo == (12.0, 13.0, 16.0) and tm.verify_hi == (30.0, 31.0, 33.0)
    assert "warning" not in log.getvalue()
    curves.update({4: [[20.0, 15.0, 16.0], [21.0, 14.0, 15.0]], 12: [[30.0, 31.0, 33.0]]})  # the dip stays
    monkeypatch.setenv("RHEOPLAN_REMEASURE", "1")
    tm = probe.measure_timings(model, draft, [1, 2, 3], tree=tree, ctx=(4, 12), sizes=(1, 2, 4), reps=1,
                               steps=4, model_id="tiny", batch_sizes=(), log=log)
    assert tm.verify_lo == (20.0, 20.0, 20.0)  # min [20, 14, 15], made monotone
    assert "warning: the verify latency at 4 cached tokens dropped" in log.getvalue()
    with pytest.raises(ValueError, match="one per size"):
        probe.retimed([1.0, 2.0], [1.0])


def test_a_verify_curve_that_jumps_after_one_token_is_timed_again_and_the_retake_kept(cache, monkeypatch):
    """A curve whose first size step costs more than the later ones together (its one-token
    forward timed in a faster spell) is measured once more; the retake, timed in one spell,
    replaces it where each size's faster median would keep the jump; a jump that survives
    the retake warns."""
    model, draft = tiny_llama(seed=1, vocab=16), tiny_llama(seed=2, vocab=16)
    tree = TreeConfig(depth=2, frontier=2, slots=2, budget=4, rheostat=1, support=8)
    curves = {4: [[10.0, 30.0, 32.0], [20.0, 21.0, 30.0]],  # jumps, then a consistent retake
              12: [[30.0, 31.0, 40.0]]}
    calls = []

    def fake(model, ctx, sizes, **kw):
        if tuple(sizes) == (1,):  # the cached record's check of the machine's speed (stale_speed_note)
            return [20.0]
        calls.append(ctx)
        return curves[ctx].pop(0)

    monkeypatch.setattr(probe, "chain_verify_ms", fake)
    log = io.StringIO()
    kw = dict(tree=tree, ctx=(4, 12), sizes=(1, 2, 32), reps=1, steps=4, model_id="tiny", batch_sizes=(), log=log)
    tm = probe.measure_timings(model, draft, [1, 2, 3], **kw)
    assert calls == [4, 4, 12]
    assert tm.verify_lo == (20.0, 21.0, 30.0)  # the retake, not the faster medians (10, 21, 30)
    assert "warning" not in log.getvalue()
    curves.update({4: [[10.0, 30.0, 32.0], [12.0, 29.0, 31.0]], 12: [[30.0, 31.0, 40.0]]})  # it stays
    monkeypatch.setenv("RHEOPLAN_REMEASURE", "1")
    tm = probe.measure_timings(model, draft, [1, 2, 3], **kw)
    assert tm.verify_lo == (10.0, 29.0, 31.0)
    assert "warning: the verify latency at 4 cached tokens jumped from 10.0 ms at 1 token to 29.0 ms at 2, more than from there to 32" in log.getvalue()
    monkeypatch.delenv("RHEOPLAN_REMEASURE")  # the cached record that jumps is not used: measured again
    curves.update({4: [[20.0, 21.0, 30.0]], 12: [[30.0, 31.0, 40.0]]})
    del calls[:]
    tm = probe.measure_timings(model, draft, [1, 2, 3], **kw)
    assert calls == [4, 12] and tm.verify_lo == (20.0, 21.0, 30.0)
    assert "cached verify latencies jump after one token" in log.getvalue()
    assert probe.measure_timings(model, draft, [1, 2, 3], **kw) == tm and calls == [4, 12]  # now it is used


def test_jumps_need_a_first_step_dearer_than_half_the_rest_and_than_the_noise():
    assert probe.jumps((1, 2, 4, 8, 16, 32, 64), (52.4, 80.1, 80.1, 80.1, 80.1, 80.9, 105.1))  # the Intel Xeon's
    assert not probe.jumps((1, 2, 4, 8, 16, 32, 64), (38.9, 38.9, 40.8, 46.7, 61.1, 93.4, 142.7))  # a clean curve
    assert not probe.jumps((1, 2, 64), (10.0, 10.3, 10.7))  # flat (a GPU): 0.3 ms is within 10% of 10 ms
    assert probe.jumps((1, 2, 64), (10.0, 12.0, 13.0))  # beyond 10%, and more than half of the rest
    assert not probe.jumps((1, 2, 64), (10.0, 12.0, 16.0))  # exactly half of the rest
    assert not probe.jumps((1, 2), (10.0, 30.0))  # no later step to compare with
    assert not probe.jumps((1, 2, 4), (10.0, 12.0, 13.0))  # two tokens more show no compute per token
    with pytest.raises(ValueError, match="one latency per size"):
        probe.jumps((1, 2, 4), (1.0, 2.0))


def test_verify_latencies_never_drop_with_more_tokens():
    assert probe.monotone([40.0, 38.0, 55.0, 50.0]) == (40.0, 40.0, 55.0, 55.0)
    assert probe.monotone([1.0]) == (1.0,)


def test_dips_name_the_spike_and_tolerate_small_noise():
    assert probe.dips((1, 2, 4, 8), (14.9, 19.8, 15.3, 17.0)) == [(2, 4), (2, 8)]
    assert probe.dips((1, 2, 4), (15.0, 14.0, 16.0)) == []  # within 10%
    assert probe.dips((1, 2), (10.0, 8.0), tolerance=0.25) == []


def test_measure_batch_verify_grid_on_a_tiny_model():
    model = tiny_llama(seed=1, vocab=16)
    ticks = []

    def clock():  # the real forwards run; the clock charges 1 ms per (row x token) forwarded
        return sum(ticks) / 1e3

    real = model.model.forward

    def counting(*a, **kw):
        ids = kw["input_ids"]
        assert kw[_hf_common._cache_kwarg(model.model)].get_seq_length() == 8  # cropped back every time
        ticks.append(ids.shape[0] * ids.shape[1])
        return real(*a, **kw)

    model.model.forward = counting
    grid = probe.measure_batch_verify(model, batch_sizes=(1, 3), row_sizes=(1, 2, 5), ctx=8, reps=1, timer=clock)
    assert [list(r) for r in grid] == [pytest.approx([1.0, 2.0, 5.0]), pytest.approx([3.0, 6.0, 15.0])]
    # a burst of load (40 ms more on three forwards in a row) spoils one sample of each size
    # at most, which the median of the round-robin rounds drops; timed size by size, it would
    # have been all three samples of the 2-token forward (calls 5-7 after its warm-up), and
    # the running maximum would have carried 42 ms up to 5 tokens
    calls = []

    def bursty(*a, **kw):
        ids = kw["input_ids"]
        calls.append(None)
        ticks.append(ids.shape[0] * ids.shape[1] + (40 if len(calls) in (6, 7, 8) else 0))
        return real(*a, **kw)

    model.model.forward = bursty
    grid = probe.measure_batch_verify(model, batch_sizes=(1,), row_sizes=(1, 2, 5), ctx=8, reps=3, timer=clock)
    assert list(grid[0]) == pytest.approx([1.0, 2.0, 5.0])
    # a load that slows every 2-token forward is not noise the median can drop: the curve is
    # still made monotone, and the log says the machine looked busy
    def slow_twos(*a, **kw):
        n = kw["input_ids"].shape[1]
        ticks.append(n * (21 if n == 2 else 1))
        return real(*a, **kw)

    model.model.forward = slow_twos
    log = io.StringIO()
    grid = probe.measure_batch_verify(model, batch_sizes=(1,), row_sizes=(1, 2, 5), ctx=8, reps=3, timer=clock, log=log)
    assert list(grid[0]) == pytest.approx([1.0, 42.0, 42.0])
    assert "dropped with more tokens (2 tokens 42.0 ms > 5 tokens 5.0 ms)" in log.getvalue()
    assert "RHEOPLAN_REMEASURE=1" in log.getvalue()
    for bad, match in ((dict(batch_sizes=()), "batch_sizes"), (dict(row_sizes=(2, 1)), "row_sizes"),
                       (dict(batch_sizes=(0, 1)), "batch_sizes"), (dict(ctx=0), "ctx=0")):
        with pytest.raises(ValueError, match=match):
            probe.measure_batch_verify(model, **bad)


def test_batch_forwards_run_the_decodes_own_call_with_its_mask(monkeypatch):
    """The grid times what a batched decode's verify forward runs (``run_base_rows``: the
    lean forward, not the transformers model's own, slower call) with the bool mask a
    ``RowCache`` forward builds, over a cache cropped back to ``ctx`` after every call, and
    after an output projection."""
    model = tiny_llama(seed=1, vocab=16)
    seen = []
    real = probe.run_base_rows

    def spy(base, cache, tok, pos, allowed, **kw):
        seen.append((tuple(tok.shape), pos.clone(), allowed.clone(), _hf_common.cache_length(cache)))
        return real(base, cache, tok, pos, allowed, **kw)

    monkeypatch.setattr(probe, "run_base_rows", spy)
    for fwd in probe.batch_forwards(model, 3, (1, 4), ctx=5):
        fwd()
        fwd()
    assert [s[0] for s in seen] == [(3, 1), (3, 1), (3, 4), (3, 4)]
    assert all(s[3] == 5 for s in seen)  # cropped back to ctx after every forward
    for (B, n), pos, allowed, _ in seen:
        assert torch.equal(pos, (5 + torch.arange(n)).expand(B, n))
        want = torch.ones(B, n, 5 + n, dtype=torch.bool)
        want[:, :, 5:] = torch.ones(n, n, dtype=torch.bool).tril()
        assert torch.equal(allowed, want)
    gaps = []
    monkeypatch.setattr(probe, "output_projection_gap", lambda m: lambda: gaps.append(None))
    probe.batch_verify_ms(model, 2, (1, 2), 5, reps=2)
    assert len(gaps) == 2 * (1 + 2)  # before every call, the warm-up ones included


def test_measure_batch_steps_takes_medians_of_the_live_steps_and_splits_the_bookkeeping_by_depth(monkeypatch):
    from rheoplan.decode import DecodeResult, StepStats

    tree = TreeConfig(depth=3, frontier=2, slots=2, budget=6, rheostat=1, support=8)
    seen = []

    def fake(model, draft, rows, *, max_new_tokens, tree=None, **kw):
        seen.append((draft is None, len(rows), max_new_tokens, None if tree is None else tree.depth))
        # step times in s: draft 4 ms (2 calls), verify 10 ms, whole step 20 ms -> 6 ms bookkeeping
        # at depth 3, 16 ms -> 2 ms at one depth; the first step (prompt through the draft) and
        # row 1's extra steps are left out
        # a one-node tree (frontier 1): 15 ms -> 1 ms
        t = (0.015 if tree is not None and tree.frontier == 1 else 0.016 if tree is not None and tree.depth == 1
             else 0.020)
        st = lambda t_step: StepStats(1, 1, 2, 1, 1, t_draft=0.004, t_verify_forward=0.010, t_step=t_step)  # noqa: E731
        steps = [st(0.5)] + [st(t)] * 3
        return [DecodeResult(tokens=[0], steps=steps), DecodeResult(tokens=[0], steps=steps + [st(9.0)] * 5)][:len(rows)]

    monkeypatch.setattr(probe, "plan_and_decode", fake)
    d, o, od, a, fw, on = probe.measure_batch_steps(None, "draft", [1, 2], tree=tree, sampling=None,
                                                    batch_sizes=(2,), steps=8)
    assert seen == [(False, 2, 8, 3), (False, 2, 8, 1), (True, 2, 8, None), (False, 2, 8, 1)]
    assert d == pytest.approx((4 / 3,))  # 4 ms over the tree's 3 depths
    assert o == pytest.approx((2.0,)) and od == pytest.approx((2.0,))  # 2 ms at one depth, +2 per further
    assert a == pytest.approx((6.0,))  # the plain steps: 20 - 4 - 10 (their draft time is 0 in life)
    assert fw == pytest.approx((10.0,))  # the plain steps' forward
    assert on == pytest.approx((1.0,))  # one node a row at one depth


def test_measure_batch_tree_verify_takes_the_real_forward_and_widest_row(monkeypatch):
    from rheoplan.decode import DecodeResult, StepStats

    tree = TreeConfig(depth=5, frontier=2, slots=2, budget=20, rheostat=1, support=8)
    seen = []

    def fake(model, draft, rows, *, max_new_tokens, tree, **kw):
        seen.append((len(rows), tree.depth, tree.budget))
        slow = 1.5 if len(seen) == 1 else 1.0  # the first decode in a slow spell
        st = lambda size, t: StepStats(size, 1, 2, 1, 1, t_verify_forward=t * slow)  # noqa: E731
        first = [st(6, 9.0)]  # the first step (prompt through the draft) is left out
        return [DecodeResult(tokens=[0], steps=first + [st(2, 0.030), st(4, 0.050), st(3, 0.040)]),
                DecodeResult(tokens=[0], steps=first + [st(5, 0.030), st(1, 0.050), st(1, 0.040)])][:len(rows)]

    monkeypatch.setattr(probe, "plan_and_decode", fake)
    out = probe.measure_batch_tree_verify(None, "draft", [1, 2], tree=tree, sampling=None, batch_sizes=(2,))
    assert seen == [(2, 3, 6)] * 2  # the small tree (depth 3, budget 6), decoded twice
    assert out == (pytest.approx((40.0, 5.0)),)  # the faster median, 40 ms; widest rows 6, 5, 4 -> 5 tokens


def test_batched_scales_set_each_real_forward_against_the_grid_timed_right_after_it(cache, monkeypatch):
    """The grid was timed in a busy spell (every forward twice its cost); the real batched
    forwards and the grid forwards of their shapes timed right after them read alike, so the
    scales are ~1, not the 0.5 and 0.25 a real forward over the early grid would give."""
    import time

    model, draft = tiny_llama(seed=1, vocab=16), tiny_llama(seed=2, vocab=16)
    tree = TreeConfig(depth=2, frontier=2, slots=2, budget=4, rheostat=1, support=8)
    extra = [0.0]  # seconds the fake forwards add to the real clock
    order = []

    def spend(ms, what):
        def fn():
            order.append(what)
            extra[0] += ms / 1e3
        return fn

    busy = ((20.0, 40.0, 80.0), (40.0, 80.0, 160.0))  # rows 1 and 4 at 1, 2, 4 tokens per row
    # (4 rows timed again, off their anchors: busy once more, so the row stays)
    monkeypatch.setattr(probe, "measure_batch_verify",
                        lambda *a, batch_sizes, **k: tuple(busy[(1, 4).index(b)] for b in batch_sizes))

    def steps(model, draft, ids, *, batch_sizes, **kw):
        order.append(("decode", tuple(batch_sizes)))
        # draft, tree bookkeeping at one depth and per further depth, plain bookkeeping, plain forward
        return (3.0,), (9.0,), (1.5,), (4.0,), (20.0,), (6.0,)

    def tree_verify(model, draft, ids, *, batch_sizes, **kw):
        order.append(("tree decode", tuple(batch_sizes)))
        return ((30.0, 3.0),)  # a 30 ms forward whose widest row held 3 tokens

    monkeypatch.setattr(probe, "measure_batch_steps", steps)
    monkeypatch.setattr(probe, "measure_batch_tree_verify", tree_verify)
    monkeypatch.setattr(probe, "batch_forwards",
                        lambda model, B, ns, ctx, gen=None: [spend(20.0 if n == 1 else 10.0 * n, (B, n)) for n in ns])
    tm = probe.measure_timings(model, draft, [1, 2, 3], tree=tree, ctx=(4, 12), sizes=(1, 2), reps=3, steps=4,
                               model_id="tiny-anchor", batch_sizes=(1, 4), batch_row_sizes=(1, 2, 4),
                               timer=lambda: time.perf_counter() + extra[0], log=io.StringIO())
    if probe.batched_decode_unavailable() is not None:
        pytest.skip("this install decodes one prompt at a time")
    # the anchor of each real forward is timed right after the decode that ran it
    moves = [x for x in order if x in {("decode", (4,)), ("tree decode", (4,))} or isinstance(x[0], int)]
    assert moves[0] == ("decode", (4,)) and moves[1] == (4, 1)
    i = moves.index(("tree decode", (4,)))
    assert moves[i + 1] == (4, 3)
    assert tm.batch_ar_scale[1] == pytest.approx(1.0, rel=0.05)
    assert tm.batch_tree_scale[1] == pytest.approx(1.0, rel=0.05)
    assert tm.batch_verify == busy and tm.batch_overhead_ms[1] == 9.0 and tm.batch_overhead_depth_ms[1] == 1.5
    assert tm.tree_overhead(4, 3) == pytest.approx(12.0)  # 9 + 2 further depths x 1.5
    # one node a row: 6 ms at one depth against the one-depth tree's 9 at its tree.slots nodes
    assert tm.batch_overhead_narrow_ms[1] == 6.0 and tm.batch_overhead_width == min(tree.budget, tree.slots)
    assert tm.tree_overhead(4, 1, width=1) == pytest.approx(6.0)
    assert tm.tree_overhead(4, 3, width=tm.batch_overhead_width) == pytest.approx(12.0)


def _batched_timings(monkeypatch, grids, plain_ms, tree_ms, log):
    """``measure_timings`` of a tiny model at rows (1, 4) x (1, 2, 4) tokens per row: the
    grid timings come from ``grids`` in turn (one per ``measure_batch_verify`` call, as
    {rows: row}); a real 4-row plain forward takes ``plain_ms``, a real 4-row tree forward
    with 3 tokens in its widest row ``tree_ms``, and so do their shapes timed again."""
    import time

    extra, calls = [0.0], []

    def grid(*a, batch_sizes, **k):
        calls.append(tuple(batch_sizes))
        g = grids[len(calls) - 1]
        return tuple(g[b] for b in batch_sizes)

    def spend(ms):
        def fn():
            extra[0] += ms / 1e3
        return fn

    monkeypatch.setattr(probe, "measure_batch_verify", grid)
    monkeypatch.setattr(probe, "measure_batch_steps", lambda *a, **k: ((3.0,), (9.0,), (0.0,), (4.0,), (plain_ms,), (6.0,)))
    monkeypatch.setattr(probe, "measure_batch_tree_verify", lambda *a, **k: ((tree_ms, 3.0),))
    monkeypatch.setattr(probe, "batch_forwards", lambda model, B, ns, ctx, gen=None:
                        [spend(plain_ms if n == 1 else tree_ms) for n in ns])
    model, draft = tiny_llama(seed=1, vocab=16), tiny_llama(seed=2, vocab=16)
    tree = TreeConfig(depth=2, frontier=2, slots=2, budget=4, rheostat=1, support=8)
    tm = probe.measure_timings(model, draft, [1, 2, 3], tree=tree, ctx=(4, 12), sizes=(1, 2), reps=3, steps=4,
                               model_id="tiny-grid-check", batch_sizes=(1, 4), batch_row_sizes=(1, 2, 4),
                               timer=lambda: time.perf_counter() + extra[0], log=log)
    if probe.batched_decode_unavailable() is not None:
        pytest.skip("this install decodes one prompt at a time")
    return tm, calls


def test_a_grid_point_off_its_anchor_has_its_row_timed_again(cache, monkeypatch):
    """The grid's 4-row one-token forward came from a busy spell (65.6 ms; it takes 37.5,
    and the rest of the row is right): its row is timed again, each point keeps the lower
    timing, and a plain 4-row step is priced at what it took, not at 65.6 x 37.5 / 37.5."""
    first = {1: (30.0, 33.0, 36.0), 4: (65.6, 48.0, 61.0)}
    again = {4: (38.0, 49.0, 60.0)}
    log = io.StringIO()
    tm, calls = _batched_timings(monkeypatch, [first, again], plain_ms=37.5, tree_ms=55.0, log=log)
    assert calls == [(1, 4), (4,)]
    assert tm.batch_verify[1] == pytest.approx((38.0, 48.0, 60.0))
    assert tm.verify_batch(4, 1, 4) == pytest.approx(37.5, rel=0.05)
    assert tm.verify_batch(4, 3, 4) == pytest.approx(55.0, rel=0.05)
    assert "batched verify latency of 4 rows (1: 65.6, 2: 48.0, 4: 61.0 ms) was off" in log.getvalue()


def test_a_grid_row_that_agrees_with_its_anchors_is_kept(cache, monkeypatch):
    first = {1: (30.0, 33.0, 36.0), 4: (40.0, 49.0, 60.0)}
    log = io.StringIO()
    tm, calls = _batched_timings(monkeypatch, [first], plain_ms=37.5, tree_ms=55.0, log=log)
    assert calls == [(1, 4)] and tm.batch_verify[1] == pytest.approx((40.0, 49.0, 60.0))
    assert tm.verify_batch(4, 1, 4) == pytest.approx(40.0, rel=0.01)  # within the tolerance the grid's level stands
    assert "timed its row again" not in log.getvalue()


def test_bookkeeping_by_depth_from_the_fixed_tree_and_its_one_depth_cut():
    tree = TreeConfig(depth=6, frontier=3, slots=3, budget=32, rheostat=1, support=8)
    one = probe.one_depth_tree(tree)
    assert (one.depth, one.budget, one.frontier, one.slots) == (1, 3, 3, 3)
    assert probe.overhead_by_depth(8.6, 4.6, 6) == pytest.approx((4.6, 0.8))
    assert probe.overhead_by_depth(4.0, 4.6, 6) == (4.6, 0.0)  # noise: never a negative cost per depth
    assert probe.overhead_by_depth(5.0, 4.6, 1) == (5.0, 0.0)  # a one-depth tree: nothing to split


@pytest.mark.parametrize("charged_ms, flagged", [(10.0, False), (12.5, False), (14.0, True), (7.0, True)])
def test_cached_latencies_far_from_a_forward_timed_now_get_a_note(charged_ms, flagged):
    """``stale_speed_note``: a one-token forward at the record's context, timed now (the
    clock charges ``charged_ms`` per forward), against the cached 10 ms: a note from 1.3x
    either way, naming both numbers and how to measure again; nothing within it."""
    model = tiny_llama(seed=1, vocab=16)
    tm = Timings((1, 4), (10.0, 12.0), (11.0, 13.0), 6, 20, (1,), (1.0,), 1.0, 1.0)
    ctxs, ticks = [], []
    real = model.model.forward

    def counting(*a, **kw):
        ids = kw["input_ids"]
        if ids.shape[1] == 1:  # the timed one-token forwards (not the prefill)
            ctxs.append(kw[_hf_common._cache_kwarg(model.model)].get_seq_length())
            ticks.append(charged_ms)
        return real(*a, **kw)

    model.model.forward = counting
    note = probe.stale_speed_note(model, tm, reps=3, timer=lambda: sum(ticks) / 1e3)
    assert set(ctxs) == {6}  # at the context the cached curve was measured at
    if flagged:
        assert f"{charged_ms:.1f} ms now against the cached 10.0 ms" in note and "RHEOPLAN_REMEASURE=1" in note
    else:
        assert note is None


def test_a_cached_record_is_checked_against_the_machine_at_load(cache, monkeypatch):
    model, draft = tiny_llama(seed=1, vocab=16), tiny_llama(seed=2, vocab=16)
    tree = TreeConfig(depth=2, frontier=2, slots=2, budget=4, rheostat=1, support=8)
    kw = dict(tree=tree, ctx=(4, 12), sizes=(1, 2), reps=1, steps=4, model_id="tiny", batch_sizes=())
    probe.measure_timings(model, draft, [1, 2, 3], log=io.StringIO(), **kw)
    seen = []
    monkeypatch.setattr(probe, "stale_speed_note", lambda m, tm, **k: seen.append(tm) or "off by 2x")
    log = io.StringIO()
    tm = probe.measure_timings(model, draft, [1, 2, 3], log=log, **kw)
    assert seen == [tm] and "cost model: off by 2x" in log.getvalue()


def test_a_message_during_the_measurement_gets_its_own_line():
    """While the first measurement's progress bar runs, a warning printed to the log lands
    on a line of its own above the bar, not glued to the bar's line."""
    import re

    from tqdm import tqdm

    out = io.StringIO()
    bar = tqdm(total=2, file=out, desc="measuring")
    bar.update()
    print("cost model: warning: a dip", file=probe._AboveBar(bar, out))
    bar.close()
    assert re.search(r"(^|[\r\n])cost model: warning: a dip\n", out.getvalue())
