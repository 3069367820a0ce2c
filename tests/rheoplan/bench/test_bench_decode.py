"""``rheoplan bench decode``: which runs it schedules, what a run records, how runs are
summarised (median and min-max over seeds) and reported. SmolLM2 is replaced by a tiny
random Llama; the real benchmark's numbers live in docs/results.md."""

from __future__ import annotations

import json

import pytest
import torch

from _bench_models import CharTokenizer, tiny_llama
from rheoplan.bench import decode as bench
from rheoplan.models.packed_linear import PackedLinear, pack_linears, packing_available


def test_plan_runs_keeps_every_seed_at_t0_but_one_rheo_variant():
    runs = bench.plan_runs(["ar-hf", "eagle", "rheo-m1-ot", "rheo-m2-rheo"], [0.0, 1.0], [0, 1, 2])
    t0 = [(n, s) for n, t, s in runs if t == 0]
    # greedy: every seed repeats the timing; rheo-m2-rheo is EAGLE's tree at T = 0, skipped
    assert t0 == [(n, s) for s in (0, 1, 2) for n in ("ar-hf", "eagle", "rheo-m1-ot")]
    t1 = [(n, s) for n, t, s in runs if t == 1.0]
    assert len(t1) == 12 and ("rheo-m2-rheo", 2) in t1


def test_load_prompts_range_and_category_mix():
    for bad in (0, 41):
        with pytest.raises(ValueError, match=r"--prompts=.*allowed \[1, 40\]"):
            bench.load_prompts(bad)
    four = bench.load_prompts(4)
    assert len({cat for cat, _ in four}) == 4  # interleaved: a small n covers every category


def _rec(method, t, seed, tau, acc, tps):
    return {"method": method, "temperature": t, "seed": seed, "mean_accepted_length": tau,
            "acceptance": acc, "tokens_per_second": tps}


def test_summarise_median_spread_and_speedup():
    recs = [_rec("ar-hf", 1.0, s, 1.0, float("nan"), tps) for s, tps in enumerate((10.0, 20.0, 12.0))]
    recs += [_rec("eagle", 1.0, s, tau, 0.4, tps) for s, (tau, tps) in enumerate(((1.5, 9.0), (1.7, 6.0), (1.6, 30.0)))]
    rows = {r["method"]: r for r in bench.summarise(recs)}
    assert rows["ar-hf"]["tps"] == (12.0, 10.0, 20.0)
    assert rows["eagle"]["seeds"] == 3
    assert rows["eagle"]["tau"] == (1.6, 1.5, 1.7)
    assert rows["eagle"]["speedup"] == pytest.approx(9.0 / 12.0)  # median over median


def test_per_seed_speedups_pair_each_run_with_its_own_seeds_generate(tmp_path):
    """Seed 1 ran in a slow spell (every method at half speed) and there the static
    generate was the fastest: per seed the method is 1.5x and 1.25x its own seed's fastest
    generate, where the ratio of the medians reads 1.5x."""
    recs = [_rec("ar-hf", 1.0, 0, 1.0, float("nan"), 40.0), _rec("ar-hf", 1.0, 1, 1.0, float("nan"), 20.0),
            _rec("ar-hf-static", 1.0, 1, 1.0, float("nan"), 24.0),
            _rec("default", 1.0, 1, 2.0, 0.5, 30.0), _rec("default", 1.0, 0, 2.0, 0.5, 60.0)]
    rows = {r["method"]: r for r in bench.summarise(recs)}
    assert rows["default"]["speedup_seeds"] == pytest.approx((1.5, 30.0 / 24.0))  # in seed order
    table = bench.report(recs, tmp_path / "t.md", tmp_path)
    assert "| 45.00 (30.00–60.00) | 1.50x (per seed 1.50, 1.25) |" in table
    assert "| ar-hf | 2 | 1.00 | – | 30.00 (20.00–40.00) | 1.00x | 1.00x |" in table  # no per-seed for generate



def _stepped(seed, tps, steps, seconds, draft, plan, verify, walk, project, commit, step):
    rec = _rec("default", 1.0, seed, 2.0, 0.5, tps)
    rec.update(steps=steps, seconds=seconds,
               phase_seconds={"draft": draft, "plan": plan, "verify_forward": verify, "walk": walk,
                              "project": project, "commit": commit, "step": step})
    return rec


def test_step_table_takes_medians_over_seeds_against_each_seeds_generate(tmp_path):
    """Where a step goes: ms per step by phase, the lean-step quantities and the accepted
    length to break even, each seed's run against the fastest generate of its own seed,
    then the median over seeds. Seed 1 ran in a slow spell (generate at 20 tok/s, its
    static variant at 10): against the median generate over seeds (30 tok/s) its
    break-even tau would read 3.0, against its slower generate 1.0, instead of 100 / 50."""
    recs = [_rec("ar-hf", 1.0, 0, 1.0, float("nan"), 40.0), _rec("ar-hf", 1.0, 1, 1.0, float("nan"), 20.0),
            _rec("ar-hf-static", 1.0, 1, 1.0, float("nan"), 10.0),
            # seed 0: 10 steps, 50 ms each (0.5 s), 40 ms of them in the steps
            _stepped(0, 40.0, 10, 0.5, draft=0.04, plan=0.02, verify=0.25, walk=0.06, project=0.03,
                     commit=0.01, step=0.40),
            # seed 1: 10 steps of 100 ms, 90 ms in the steps
            _stepped(1, 20.0, 10, 1.0, draft=0.10, plan=0.06, verify=0.60, walk=0.10, project=0.04,
                     commit=0.02, step=0.90)]
    rows = bench.step_rows(recs)
    assert [r["method"] for r in rows] == ["default"]  # generate has no steps to split
    r = rows[0]
    assert r["seeds"] == 2
    assert r["step_ms"] == pytest.approx(75.0)  # median of 50 and 100
    assert r["draft"] == pytest.approx(7.0) and r["plan"] == pytest.approx(4.0)
    # plan + walk + commit + the loop's own time (the steps' wall time less the phases)
    book0 = 2.0 + 6.0 + 1.0 + (40.0 - 4.0 - 2.0 - 25.0 - 6.0 - 1.0)
    book1 = 6.0 + 10.0 + 2.0 + (90.0 - 10.0 - 6.0 - 60.0 - 10.0 - 2.0)
    assert r["bookkeeping_ms"] == pytest.approx((book0 + book1) / 2)
    assert r["bookkeeping_no_projection_ms"] == pytest.approx((book0 - 3.0 + book1 - 4.0) / 2)
    assert r["depth_vs_head_forward"] == pytest.approx((6.0 / 4.0 + 16.0 / 10.0) / 2)
    # break-even tau: ms per step / generate's ms per token of the same seed (40 and 20 tok/s)
    assert r["break_even_tau"] == pytest.approx((50.0 / 25.0 + 100.0 / 50.0) / 2)
    assert r["tau_for_1_3x"] == pytest.approx(1.3 * 2.0)
    table = bench.report(recs, tmp_path / "t.md", tmp_path)
    assert "| float32 | 1.0 | default | 2 | 75.00 | 7.00 | 4.00 | 42.50 | 8.00 (3.50) | 1.50 | " in table
    assert "| 1.55x | 2.00 / 2.60 |" in table
    header, rule = bench.step_table(recs).splitlines()[:2]
    assert header.count("|") == rule.count("|")  # a well-formed markdown table


def test_step_table_leaves_out_runs_without_their_seeds_generate():
    recs = [_rec("ar-hf", 1.0, 0, 1.0, float("nan"), 40.0),
            _stepped(1, 20.0, 10, 1.0, draft=0.1, plan=0.06, verify=0.6, walk=0.1, project=0.04, commit=0.02,
                     step=0.9)]
    assert bench.step_rows(recs) == [] and bench.step_table(recs) == ""

def test_report_table_and_plots(tmp_path):
    recs = [_rec("ar-hf", 0.6, 0, 1.0, float("nan"), 10.0), _rec("eagle", 0.6, 0, 1.5, 0.25, 8.0),
            _rec("eagle", 0.6, 1, 1.7, 0.35, 9.0)]
    table = bench.report(recs, tmp_path / "t.md", tmp_path)
    assert ("| float32 | 0.6 | eagle | 2 | 1.60 (1.50–1.70) | 30.0% (25.0%–35.0%) | 8.50 (8.00–9.00) | 0.85x | "
            "0.85x |") in table
    assert "| float32 | 0.6 | ar-hf | 1 | 1.00 | – | 10.00 | 1.00x | 1.00x |" in table
    assert (tmp_path / "t.md").read_text().strip() == table
    assert (tmp_path / "accepted_length.png").stat().st_size > 0


def test_dtypes_are_summarised_and_plotted_apart(tmp_path):
    """A bfloat16 run is compared with the bfloat16 ``generate`` only; records written
    before the dtype field count as float32."""
    recs = [_rec("ar-hf", 1.0, 0, 1.0, float("nan"), 10.0), _rec("eagle", 1.0, 0, 1.5, 0.3, 8.0),
            dict(_rec("ar-hf", 1.0, 0, 1.0, float("nan"), 20.0), dtype="bfloat16"),
            dict(_rec("eagle", 1.0, 0, 1.5, 0.3, 30.0), dtype="bfloat16")]
    rows = {(r["method"], r["dtype"]): r for r in bench.summarise(recs)}
    assert rows["eagle", "float32"]["speedup"] == pytest.approx(0.8)
    assert rows["eagle", "bfloat16"]["speedup"] == pytest.approx(1.5)
    bench.report(recs, tmp_path / "t.md", tmp_path)
    assert (tmp_path / "speedup.png").exists() and (tmp_path / "speedup_bfloat16.png").exists()


def test_second_speedup_is_against_the_fastest_generate_of_any_dtype(tmp_path):
    """A bfloat16 run's own column compares with bfloat16 ``generate``; the second with the
    fastest ``generate`` at that temperature in any dtype: ``ar-hf-f32`` run beside it, or a
    float32 run's. ``ar-hf-f32`` is no same-dtype baseline of a bfloat16 run."""
    bf = dict(dtype="bfloat16")
    recs = [dict(_rec("ar-hf", 1.0, 0, 1.0, float("nan"), 10.0), **bf, generate_dtype="bfloat16"),
            dict(_rec("ar-hf-f32", 1.0, 0, 1.0, float("nan"), 14.0), **bf, generate_dtype="float32"),
            dict(_rec("default", 1.0, 0, 2.0, 0.5, 21.0), **bf),
            _rec("ar-hf", 0.0, 0, 1.0, float("nan"), 12.0),
            dict(_rec("ar-hf", 0.0, 0, 1.0, float("nan"), 11.0), **bf), dict(_rec("default", 0.0, 0, 2.0, 0.5, 18.0), **bf)]
    rows = {(r["method"], r["temperature"]): r for r in bench.summarise(recs)}
    assert rows["default", 1.0]["speedup"] == pytest.approx(21.0 / 10.0)
    assert rows["default", 1.0]["speedup_any"] == pytest.approx(21.0 / 14.0)
    assert rows["default", 0.0]["speedup"] == pytest.approx(18.0 / 11.0)
    assert rows["default", 0.0]["speedup_any"] == pytest.approx(18.0 / 12.0)  # the float32 run's generate
    table = bench.report(recs, tmp_path / "t.md", tmp_path)
    assert "| bfloat16 | 1.0 | default | 1 | 2.00 | 50.0% | 21.00 | 2.10x | 1.50x |" in table


def test_ar_hf_f32_generates_on_one_float32_copy_of_a_bfloat16_model(monkeypatch):
    plain = tiny_llama(0)
    assert bench.float32_model(plain) is plain  # float32 already: the model itself
    target = tiny_llama(0).to(torch.bfloat16)
    n = pack_linears(target) if packing_available(torch.bfloat16, "cpu") else 0
    twin = bench.float32_model(target)
    assert twin is not target and bench.float32_model(target) is twin  # made once
    assert next(twin.parameters()).dtype is torch.float32
    assert sum(isinstance(m, PackedLinear) for m in target.modules()) == n  # the model stays as it was
    ran, real = [], twin.generate
    monkeypatch.setattr(twin, "generate", lambda *a, **kw: ran.append(1) or real(*a, **kw))
    rec = bench.run_one(target, CharTokenizer(), None, bench.methods_for(3, 2, 2, 5)["ar-hf-f32"],
                        [("chat", "hello")], temperature=1.0, seed=0, tokens=4)
    assert ran == [1, 1] and rec["tokens"] == 4  # the copy generated (the untimed warm-up, then the prompt)
    assert rec["dtype"] == "bfloat16" and rec["generate_dtype"] == "float32"


@pytest.mark.parametrize("name", ["ar-hf", "eagle", "rheo-m1-ot"])
def test_run_one_records_tokens_steps_and_phases(name):
    target, draft = tiny_llama(0), tiny_llama(1, layers=1)
    method = bench.methods_for(3, 2, 2, 5)[name]
    rec = bench.run_one(target, CharTokenizer(), draft, method, [("chat", "hello"), ("code", "def f")],
                        temperature=1.0, seed=0, tokens=6)
    assert rec["tokens"] == 12 and rec["prompts"] == 2
    assert rec["seconds"] > 0 and rec["tokens_per_second"] == pytest.approx(12 / rec["seconds"])
    if name == "ar-hf":
        assert rec["steps"] == 12 and rec["tree"] is None and rec["phase_seconds"] == {}
    else:
        assert 2 <= rec["steps"] <= 12
        assert rec["mean_accepted_length"] == pytest.approx(12 / rec["steps"])
        assert set(rec["phase_seconds"]) == {"draft", "plan", "verify_forward", "walk", "commit", "project", "step"}
        ps = dict(rec["phase_seconds"])
        step = ps.pop("step")  # the steps' wall time: the phases fit in it, it fits in the run
        project = ps.pop("project")  # part of the walk
        assert 0 < project <= ps["walk"]
        assert sum(ps.values()) <= step <= rec["seconds"]
    assert rec["dtype"] == "float32" and rec["threads"] >= 1
    json.dumps(rec)  # a run record must be writable as JSON


@pytest.mark.parametrize("argv, match", [
    (["--methods", "eagel"], "--methods: unknown \\['eagel'\\]"),
    (["--tokens", "0"], r"--tokens=0: allowed >= 1"),
    (["--threads", "0"], r"--threads=0: allowed >= 1"),  # was silently ignored before
])
def test_main_rejects_bad_arguments_before_loading(monkeypatch, tmp_path, argv, match):
    import rheoplan.cli as cli

    monkeypatch.setattr(cli, "load_default", lambda *a: pytest.fail("model loaded before validation"))
    with pytest.raises(ValueError, match=match):
        bench.main(argv + ["--out", str(tmp_path)])


def test_speedup_is_against_the_fastest_generate_and_failures_are_reported(tmp_path):
    recs = [_rec("ar-hf", 1.0, 0, 1.0, float("nan"), 10.0), _rec("ar-hf-static", 1.0, 0, 1.0, float("nan"), 16.0),
            _rec("eagle", 1.0, 0, 1.5, 0.3, 20.0),
            {"method": "ar-hf-static", "temperature": 0.0, "seed": 0, "error": "static cache + torch.compile failed "
             "here: BackendCompilerFailed: no compiler"},
            _rec("ar-hf", 0.0, 0, 1.0, float("nan"), 12.0), _rec("eagle", 0.0, 0, 1.5, 0.3, 18.0)]
    recs[2]["predicted_tokens_per_step"] = 1.62
    for r in recs:
        r["machine"] = {"cpu": "AMD EPYC test", "flags": ["avx2", "avx512_bf16"], "threads": 2, "cores": 2,
                        "torch": "2.x", "transformers": "5.x"}
    rows = {(r["method"], r["temperature"]): r for r in bench.summarise(recs)}
    assert rows["eagle", 1.0]["speedup"] == pytest.approx(20.0 / 16.0)  # the static path was faster
    assert rows["eagle", 0.0]["speedup"] == pytest.approx(18.0 / 12.0)  # a failed variant is no baseline
    table = bench.report(recs, tmp_path / "t.md", tmp_path)
    assert "Machine: AMD EPYC test; flags: avx2 avx512_bf16; 2 torch threads of 2 cores" in table
    assert "| float32 | 0.0 | ar-hf-static | 1 | failed: static cache + torch.compile failed here" in table
    assert "| float32 | 1.0 | eagle | 1 | 1.50 (1.62) |" in table


def test_machine_info_names_the_cpu():
    info = bench.machine_info()
    assert info["cpu"] and isinstance(info["flags"], list) and info["threads"] >= 1


@pytest.mark.slow
def test_static_generate_compiles_and_runs_on_this_machine():
    target = tiny_llama(0)
    seconds, err = bench.warm_static_generate(target, CharTokenizer())
    assert err is None and seconds > 0
    rec = bench.run_one(target, CharTokenizer(), None, bench.methods_for(3, 2, 2, 5)["ar-hf-static"],
                        [("chat", "hello")], temperature=1.0, seed=0, tokens=5)
    assert rec["tokens"] == 5


def test_default_method_runs_the_cost_model_and_records_its_prediction():
    from rheoplan.costmodel import CostModel, Timings

    target, draft = tiny_llama(0), tiny_llama(1, layers=1)
    method = bench.methods_for(3, 2, 2, 5)["default"]
    assert method.cost and method.tree.budget > 5  # its own largest tree, not the fixed one
    with pytest.raises(ValueError, match="pass cost_model="):
        bench.run_one(target, CharTokenizer(), draft, method, [("chat", "hello")], 1.0, 0, 4)
    cost = CostModel(Timings((1, 64), (10.0, 40.0), (12.0, 50.0), 0, 1000, (1,), (1.0,), 0.5, 0.5))
    rec = bench.run_one(target, CharTokenizer(), draft, method, [("chat", "hello"), ("code", "def f")],
                        temperature=1.0, seed=0, tokens=6, cost_model=cost)
    assert rec["tokens"] == 12 and rec["predicted_tokens_per_step"] >= 1.0
    assert rec["autoregressive_steps"] is not None
    other = bench.methods_for(3, 2, 2, 5)["default-ot"]  # the same planning, the ot verifier
    assert other.cost and other.tree == method.tree.with_(verifier="ot") and method.tree.verifier == "rheo"
    rec = bench.run_one(target, CharTokenizer(), draft, other, [("chat", "hello")], 1.0, 0, 6, cost_model=cost)
    assert rec["method"] == "default-ot" and rec["tokens"] == 6


def test_run_group_interleaves_prompt_by_prompt_and_rotates(monkeypatch):
    """Every method first decodes WARM_UP_TOKENS of the first prompt (untimed), then prompt
    j before any starts prompt j + 1, the first method of each prompt rotating; the records
    equal one run per method (same seeds per prompt)."""
    target, draft = tiny_llama(0), tiny_llama(1, layers=1)
    methods = bench.methods_for(3, 2, 2, 5)
    runs = [(methods["ar-hf"], None), (methods["eagle"], draft), (methods["rheo-m1-ot"], draft)]
    prompts = [("chat", "hello"), ("code", "def f"), ("math", "1+1")]
    calls = []
    real = bench.decode_prompt

    def spy(model, tok, d, method, ids, temperature, seed, tokens, cost_model=None):
        calls.append((method.name, seed, tokens))
        return real(model, tok, d, method, ids, temperature, seed, tokens, cost_model=cost_model)

    monkeypatch.setattr(bench, "decode_prompt", spy)
    recs = bench.run_group(target, CharTokenizer(), runs, prompts, temperature=1.0, seed=2, tokens=5)
    assert [r["method"] for r in recs] == ["ar-hf", "eagle", "rheo-m1-ot"]
    w = bench.WARM_UP_TOKENS
    assert calls == [("ar-hf", 2, w), ("eagle", 2, w), ("rheo-m1-ot", 2, w),
                     ("ar-hf", 2000, 5), ("eagle", 2000, 5), ("rheo-m1-ot", 2000, 5),
                     ("eagle", 2001, 5), ("rheo-m1-ot", 2001, 5), ("ar-hf", 2001, 5),
                     ("rheo-m1-ot", 2002, 5), ("ar-hf", 2002, 5), ("eagle", 2002, 5)]
    for rec, (m, d) in zip(recs, runs):
        alone = bench.run_one(target, CharTokenizer(), d, m, prompts, temperature=1.0, seed=2, tokens=5)
        assert (rec["tokens"], rec["steps"]) == (alone["tokens"], alone["steps"])


def test_main_writes_one_record_per_method_and_resumes_by_group(monkeypatch, tmp_path):
    target, draft = tiny_llama(0), tiny_llama(1, layers=1)
    monkeypatch.setattr(bench, "load_default", lambda **kw: (target, CharTokenizer(), draft))
    monkeypatch.setattr(bench, "load_prompts", lambda n: [("chat", "hello"), ("code", "def f")][:n])
    groups = []
    real = bench.run_group
    monkeypatch.setattr(bench, "run_group", lambda *a, **k: groups.append([m.name for m, _ in a[2]]) or real(*a, **k))
    argv = ["--methods", "ar-hf", "eagle", "--temperatures", "1", "--seeds", "0", "1", "--prompts", "2",
            "--tokens", "3", "--dtype", "float32", "--out", str(tmp_path)]
    assert bench.main(argv) == 0
    assert groups == [["ar-hf", "eagle"], ["ar-hf", "eagle"]]
    assert len(list((tmp_path / "runs").glob("*.json"))) == 4
    (tmp_path / "runs" / "eagle_T1.0_s1_p2_n3_float32.json").unlink()
    groups.clear()
    assert bench.main(argv) == 0
    assert groups == [["eagle"]]  # only the missing run of the unfinished group


@pytest.mark.skipif(not packing_available(torch.bfloat16, "cpu"), reason="no oneDNN linear packing in this build")
def test_ar_hf_unpacked_generates_on_plain_weights_and_packs_them_again(monkeypatch):
    target = tiny_llama(0).to(torch.bfloat16)
    n = pack_linears(target)
    seen = []
    real = target.generate

    def gen(*a, **kw):
        seen.append(sum(isinstance(m, PackedLinear) for m in target.modules()))
        return real(*a, **kw)

    monkeypatch.setattr(target, "generate", gen)
    methods = bench.methods_for(3, 2, 2, 5)
    for name, packed in (("ar-hf-unpacked", 0), ("ar-hf", n)):
        seen.clear()
        rec = bench.run_one(target, CharTokenizer(), None, methods[name], [("chat", "hello")], temperature=1.0,
                            seed=0, tokens=4)
        assert rec["tokens"] == 4
        # every generate call of the run (the untimed warm-up and the timed decode) on those weights
        assert len(seen) == 2 and set(seen) == {packed}, (name, seen)
    assert sum(isinstance(m, PackedLinear) for m in target.modules()) == n


@pytest.mark.skipif(not packing_available(torch.bfloat16, "cpu"), reason="no oneDNN packing in this torch build")
def test_static_generate_runs_an_unpacked_copy_of_a_packed_model():
    """``ar-hf-static`` on a packed model: inductor cannot lower prepacked weights, so it runs
    on one unpacked copy (same weights, same greedy tokens), made once; the model itself
    stays packed, and a model without packed weights is used as it is."""
    plain = tiny_llama(0).to(torch.bfloat16)
    assert bench.static_model(plain) is plain
    target = tiny_llama(0).to(torch.bfloat16)
    n = pack_linears(target)
    twin = bench.static_model(target)
    assert twin is not target and bench.static_model(target) is twin
    assert not any(isinstance(m, PackedLinear) for m in twin.modules())
    assert sum(isinstance(m, PackedLinear) for m in target.modules()) == n
    for (k, a), (_, b) in zip(target.state_dict().items(), twin.state_dict().items()):
        assert torch.equal(a, b), k
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        kw = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
        assert torch.equal(target.generate(ids, **kw), twin.generate(ids, **kw))
