"""``rheoplan bench batch``: flag checks (each error names its flag, before any model
work), the padded batch, the interleaved runs and their records, the summary, table and
plot. SmolLM2 is replaced by tiny random Llamas; the real numbers live in docs/results.md."""

from __future__ import annotations

import pytest
import torch

from _bench_models import tiny_llama
from rheoplan import cli, probe
from rheoplan.bench import batch as bench
from rheoplan.config import TreeConfig
from rheoplan.costmodel import CostModel, Timings
from rheoplan.decode import DecodeResult, StepStats
from rheoplan.models.packed_linear import PackedLinear, pack_linears, packing_available


def run_cli(argv, capsys):
    rc = cli.main(argv)
    return rc, capsys.readouterr().err


@pytest.mark.parametrize("argv,match", [
    (["--batch-sizes", "0", "4"], "--batch-sizes=[0, 4]: allowed ints >= 1"),
    (["--batch-sizes", "4", "4"], "--batch-sizes=[4, 4]: each batch size once"),
    (["--batch-sizes", "7", "16"], "--batch-sizes=[7, 16]: whole batches of every size need a multiple of 112"),
    (["--tokens", "0"], "--tokens=0: allowed >= 1"),
    (["--prompts", "12"], "--prompts=12 is not a multiple of --batch-sizes [16]"),
    (["--prompts", "48", "--batch-sizes", "16"], "--prompts=48 is out of range: allowed [1, 40]"),
    (["--temperatures", "-1"], "--temperatures: temperature"),
    (["--seeds", "-2"], "--seeds=[-2]: allowed ints >= 0"),
    (["--methods", "generate", "generate"], "--methods=['generate', 'generate']: allowed each of"),
    (["--threads", "0"], "--threads=0: allowed >= 1"),
    (["--methods", "queued"], "--methods queued: the speed-ups are against generate; add generate"),
])
def test_bad_flags_fail_before_any_model_loads(argv, match, capsys, monkeypatch):
    def no_model(*a, **k):
        raise AssertionError("the model must not load before the flags are checked")

    monkeypatch.setattr(bench, "load_default", no_model)
    rc, err = run_cli(["bench", "batch", *argv], capsys)
    assert rc == 2 and "rheoplan bench: error: " in err and match in err, err


def test_unknown_method_is_argparse_error(capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "batch", "--methods", "speculative"])
    assert "invalid choice: 'speculative'" in capsys.readouterr().err


def test_default_prompts_split_into_whole_batches():
    # two batches of the largest size where the 40 held-out prompts allow it, else one
    assert bench.default_prompts([1, 4, 16]) == 32 and bench.default_prompts([2, 3]) == 6
    assert bench.default_prompts([1]) == 2 and bench.default_prompts([4, 5]) == 20
    assert bench.default_prompts([1, 4, 32]) == 32 and bench.default_prompts([8, 12]) == 24


def test_left_pad():
    ids, mask = bench.left_pad([[5, 6], [7]], 0)
    assert ids.tolist() == [[5, 6], [0, 7]] and mask.tolist() == [[1, 1], [0, 1]]


def test_batched_method_needs_a_plan_and_decode_that_takes_a_list(monkeypatch):
    def one_prompt_only(target, draft, prompt_ids, **kw):
        raise TypeError("prompt_ids=[[0, 1], [1, 2, 3]] holds a list: allowed token ids")

    monkeypatch.setattr(probe, "plan_and_decode", one_prompt_only)
    with pytest.raises(bench.BatchedDecodeUnavailable, match=r"--methods batched needs plan_and_decode to accept a "
                                                              r"list of prompts .*raised TypeError"):
        bench.check_batched_decode()
    monkeypatch.setattr(probe, "plan_and_decode", lambda *a, **k: DecodeResult(tokens=[1]))
    with pytest.raises(bench.BatchedDecodeUnavailable, match="returned DecodeResult, not one result per row"):
        bench.check_batched_decode()
    monkeypatch.setattr(probe, "plan_and_decode", lambda t, d, rows, **k: [DecodeResult(tokens=[1]) for _ in rows])
    bench.check_batched_decode()  # a batched plan_and_decode passes


def cost_model() -> CostModel:
    rows, sizes = (1, 2, 4, 8), (1, 4, 16)
    tm = Timings((1, 64), (5.0, 68.0), (5.0, 68.0), 0, 1000, (1,), (0.5,), 0.1, 0.1, sizes, rows,
                 tuple(tuple(4.0 + B * n for n in rows) for B in sizes))
    return CostModel(tm)


def fake_batched(target, draft, prompts, *, max_new_tokens, **kw):
    """Stands in for the batched loop where it has not landed: two steps per row."""
    half = max_new_tokens // 2
    st = [StepStats(3, half - 1, half, 1, 1), StepStats(0, max_new_tokens - half - 1, max_new_tokens - half, 0, 0,
                                                          drafted=False)]
    return [DecodeResult(tokens=[1] * max_new_tokens, steps=list(st)) for _ in prompts]


def test_run_batch_size_interleaves_every_method_over_the_same_rows(monkeypatch):
    model, draft = tiny_llama(seed=1), tiny_llama(seed=2, layers=1)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [3, 3]]
    calls = []
    real = bench.plan_and_decode

    def spy(target, d, ids, **kw):
        kind = "row" if not isinstance(ids[0], list) else "queued" if kw.get("max_batch_size") else "batched"
        calls.append((kind, kw["seed"], len(ids), kw.get("max_batch_size")))
        return fake_batched(target, d, ids, **kw) if isinstance(ids[0], list) else real(target, d, ids, **kw)

    monkeypatch.setattr(bench, "plan_and_decode", spy)
    tree = TreeConfig(depth=2, frontier=2, slots=2, budget=4, support=8)
    recs = bench.run_batch_size(model, 0, draft, prompts, 2, 1.0, 3, 6, bench.METHODS, cost_model(), tree)
    by = {r["method"]: r for r in recs}
    assert set(by) == set(bench.METHODS)
    for r in recs:  # every method emitted exactly tokens x rows
        assert r["tokens"] == 6 * 4 and r["seconds"] > 0 and r["batch_size"] == 2 and r["prompts"] == 4
        assert r["tokens_per_second"] == pytest.approx(r["tokens"] / r["seconds"])
    assert by["generate"]["mean_accepted_length"] == 1.0 and by["generate"]["kept_per_row"] == 0.0
    assert by["batched"]["mean_accepted_length"] == 3.0  # 6 tokens in 2 steps per row
    assert by["batched"]["kept_per_row"] == 3.0 and by["batched"]["drafted_share"] == 0.5
    assert by["rowwise"]["mean_accepted_length"] >= 1.0
    # two batches: rows of batch k seed 3000 + k*2 (+ row index for the batch-1 loop)
    assert calls.count(("batched", 3000, 2, None)) == 1 and calls.count(("batched", 3002, 2, None)) == 1
    assert [c[1] for c in calls if c[0] == "row"] == [3000, 3001, 3002, 3003]
    # queued: every row at once, at most 2 live, halfway through (after the first batch's methods)
    assert [c for c in calls if c[0] == "queued"] == [("queued", 3000, 4, 2)]
    first_queued = next(i for i, c in enumerate(calls) if c[0] == "queued")
    assert ("batched", 3000, 2, None) in calls[:first_queued] and ("batched", 3002, 2, None) in calls[first_queued:]
    assert by["queued"]["tokens"] == 6 * 4 and by["queued"]["mean_accepted_length"] == 3.0


def test_warm_up_runs_every_batch_size_temperature_and_method_untimed(monkeypatch):
    """Before any timed batch, one short batch of each size (its own shapes), per
    temperature, with every method."""
    seen = []
    monkeypatch.setattr(bench, "run_batch_size", lambda model, pad, draft, rows, b, t, seed, tokens, methods, cost,
                        tree: seen.append((len(rows), b, t, tokens, tuple(methods))))
    prompts = [[i, i + 1] for i in range(16)]
    bench.warm_up("m", 0, "d", prompts, [1, 4, 16], [1.0, 0.0], ["generate", "batched"], None, "tree")
    assert seen == [(b, b, t, bench.WARM_TOKENS, ("generate", "batched")) for t in (1.0, 0.0) for b in (1, 4, 16)]


def test_method_order_rotates_by_batch_and_by_seed(monkeypatch):
    """The method that goes first rotates from batch to batch and from seed to seed: with
    one batch holding every prompt, the seeds alone change which method runs first."""
    order = []

    def fake(name):
        def run(*a, **kw):
            order.append(name)
            return {"tokens": 4, "seconds": 1.0, "row_tau": [1.0], "kept_sum": 0, "drafted_steps": 0, "steps": 4}
        return run

    monkeypatch.setattr(bench, "run_generate", fake("generate"))
    monkeypatch.setattr(bench, "run_rowwise", fake("rowwise"))
    monkeypatch.setattr(bench, "run_batched", fake("batched"))
    methods = ["generate", "rowwise", "batched"]
    firsts = []
    for seed in range(3):
        order.clear()
        bench.run_batch_size(None, 0, None, [[1], [2]], 2, 1.0, seed, 4, methods, None, None)
        assert sorted(order) == sorted(methods)
        firsts.append(order[0])
    assert firsts == methods
    order.clear()
    bench.run_batch_size(None, 0, None, [[1], [2], [3], [4]], 2, 1.0, 1, 4, methods, None, None)
    assert order == ["rowwise", "batched", "generate", "batched", "generate", "rowwise"]


def test_generate_gets_the_left_padded_batch(monkeypatch):
    model = tiny_llama(seed=1)
    seen = {}
    real = model.generate

    def gen(ids, attention_mask, **kw):
        seen["ids"], seen["mask"] = ids.clone(), attention_mask.clone()
        return real(ids, attention_mask=attention_mask, **kw)

    monkeypatch.setattr(model, "generate", gen)
    r = bench.run_generate(model, 0, [[1, 2, 3], [4]], 0.0, 0, 5)
    assert r["tokens"] == 10 and seen["ids"].tolist() == [[1, 2, 3], [0, 0, 4]]
    assert seen["mask"].tolist() == [[1, 1, 1], [0, 0, 1]]


def _rec(method, b, t, seed, tps, tau=1.0, kept=0.0, share=0.0):
    return {"method": method, "batch_size": b, "temperature": t, "seed": seed, "dtype": "bfloat16",
            "tokens_per_second": tps, "mean_accepted_length": tau, "kept_per_row": kept, "drafted_share": share,
            "plan": None if method == "generate" else {"depth": 3 if b == 1 else 0, "width": 1,
                                                       "budget": 3 if b == 1 else 0}}


def test_summary_speedup_is_against_generate_at_the_same_batch_size(tmp_path):
    recs = [_rec("generate", 1, 1.0, 0, 20.0), _rec("generate", 1, 1.0, 1, 30.0), _rec("generate", 4, 1.0, 0, 60.0),
            _rec("batched", 1, 1.0, 1, 50.0, 2.7, 4.0, 1.0), _rec("batched", 1, 1.0, 0, 40.0, 2.5, 4.0, 1.0),
            _rec("batched", 4, 1.0, 0, 90.0, 1.2, 1.0, 0.25), _rec("rowwise", 4, 1.0, 0, 45.0, 2.6, 4.0, 1.0)]
    rows = {(r["batch_size"], r["method"]): r for r in bench.summarise(recs)}
    assert rows[1, "batched"]["speedup"] == pytest.approx(45.0 / 25.0)  # median over median, same B
    assert rows[4, "batched"]["speedup"] == pytest.approx(1.5) and rows[4, "rowwise"]["speedup"] == 0.75
    table = bench.report(bench.summarise(recs))
    # per seed, each run against generate's run of its own seed (seed order, whatever the record order)
    assert rows[1, "batched"]["speedup_seeds"] == pytest.approx((2.0, 50.0 / 30.0))
    assert ("| bfloat16 | 1.0 | 1 | batched | 2 | 45.0 (40.0–50.0) | 1.80x (per seed 2.00, 1.67) | 2.60 | 3 / 1 / 3 "
            "| 4.00 (100% of steps) |") in table
    assert "| bfloat16 | 1.0 | 1 | generate | 2 | 25.0 (20.0–30.0) | 1.00x |" in table
    assert "| bfloat16 | 1.0 | 4 | batched | 1 | 90.0 | 1.50x | 1.20 | 0 / 1 / 0 | 1.00 (25% of steps) |" in table
    assert "| bfloat16 | 1.0 | 4 | generate | 1 | 60.0 | 1.00x | 1.00 | – | – |" in table
    png = bench.plot(bench.summarise(recs), tmp_path / "img" / "batch.png")
    assert png.stat().st_size > 0


def test_the_real_batched_loop_end_to_end_when_it_exists():
    try:
        bench.check_batched_decode()
    except bench.BatchedDecodeUnavailable as exc:
        pytest.skip(f"batched decoding has not landed: {exc}")
    model, draft = tiny_llama(seed=1), tiny_llama(seed=2, layers=1)
    tree = TreeConfig(depth=2, frontier=2, slots=2, budget=4, support=8)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [3, 3]]
    for t in (1.0, 0.0):
        (rec,) = bench.run_batch_size(model, 0, draft, prompts, 4, t, 0, 5, ["batched"], cost_model(), tree)
        assert rec["tokens"] == 5 * 4 and rec["mean_accepted_length"] >= 1.0 and 0.0 <= rec["drafted_share"] <= 1.0


def test_needs_table_reads_the_cost_models_answers():
    from rheoplan.costmodel import CostModel, Timings

    rows, sizes = (1, 2, 4, 8), (1, 4, 16)
    tm = Timings((1, 64), (5.0, 68.0), (5.0, 68.0), 0, 1000, (1,), (0.5,), 0.0, 0.0, sizes, rows,
                 tuple(tuple(4.0 + B * n for n in rows) for B in sizes))
    cost = CostModel(tm)
    needs = {b: {f"{x}x": cost.needed_continuation(b, x, ctx=64, max_depth=4) for x in bench.NEED_SPEEDUPS}
             for b in sizes}
    assert needs[16]["1.3x"] is None and needs[1]["1.3x"] is not None
    text = bench.needs_table(needs)
    c, d = needs[1]["1.3x"]
    assert "| batch | 1.05x: rate (depth) | 1.3x: rate (depth) |" in text
    assert f"{c:.2f} ({d})" in text and "| 16 |" in text and "out of reach" in text


@pytest.mark.skipif(not packing_available(torch.bfloat16, "cpu"), reason="no oneDNN linear packing in this build")
def test_generate_unpacked_runs_on_plain_weights_and_packs_them_again(monkeypatch):
    model = tiny_llama(seed=1).to(torch.bfloat16)
    n = pack_linears(model)
    seen = []
    real = model.generate

    def gen(ids, attention_mask, **kw):
        seen.append(sum(isinstance(m, PackedLinear) for m in model.modules()))
        return real(ids, attention_mask=attention_mask, **kw)

    monkeypatch.setattr(model, "generate", gen)
    bench.run_generate(model, 0, [[1, 2, 3]], 0.0, 0, 3, unpacked=True)
    bench.run_generate(model, 0, [[1, 2, 3]], 0.0, 0, 3)
    assert seen == [0, n] and sum(isinstance(m, PackedLinear) for m in model.modules()) == n
