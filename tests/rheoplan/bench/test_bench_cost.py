"""``rheoplan bench cost``: its tables, the forward-cost curve (on a tiny
random Llama: it must leave the cache as it found it) and argument checks that run
before any model loads."""

from __future__ import annotations

import pytest

from _bench_models import phase_record, tiny_llama
from rheoplan.bench import cost


def test_forward_curve_reports_each_size():
    # forward_curve asserts itself that every timed forward is cropped back off the cache
    rows = cost.forward_curve(tiny_llama(0), list(range(1, 21)), [1, 3, 8], repeats=2)
    assert [r["tokens"] for r in rows] == [1, 3, 8]
    assert all(r["stack_ms"] > 0 and r["head_ms"] > 0 for r in rows)


@pytest.mark.parametrize("argv, match", [
    (["--sizes", "0", "4"], r"--sizes=\[0, 4\]: each must be in \[1, 256\]"),
    (["--tokens", "0"], r"--tokens=0: allowed >= 1"),
    (["--repeats", "0"], r"--repeats=0: allowed >= 1"),
    (["--context", "0"], r"--context=0: allowed \[1, 4096\]"),
    (["--prompts", "99"], r"--prompts=99 is out of range"),
    (["--temperature", "-1"], r"temperature"),
    (["--threads", "0"], r"--threads=0: allowed >= 1"),
])
def test_bad_arguments_fail_before_the_model_loads(monkeypatch, tmp_path, argv, match):
    import rheoplan.cli as cli

    monkeypatch.setattr(cli, "load_default", lambda *a: pytest.fail("model loaded before validation"))
    with pytest.raises(ValueError, match=match):
        cost.main(argv + ["--out", str(tmp_path)])


def test_report_tables():
    rows = [cost.breakdown(phase_record(), 50.0)]
    text = cost.report(rows, [{"tokens": 1, "stack_ms": 40.0, "head_ms": 10.0},
                              {"tokens": 8, "stack_ms": 80.0, "head_ms": 30.0}], 50.0)
    assert "| rheo-m1-ot | 2.00 | 20.0 | 10.0 | 90.0 | 10.0 | 5.0 | 15.0 | 150.0 | 75.0 | 3.00 | 3.90 |" in text
    header, rule = text.splitlines()[:2]
    assert header.count("|") == rule.count("|")  # a well-formed markdown table
    assert "| 8 | 80.0 | 30.0 | 2.00x |" in text


def test_lean_checks_split_prefill_from_the_loop_and_compare_with_generate():
    rec = phase_record()
    rec["phase_seconds"]["step"] = 1.4  # the steps' wall time: 0.1 s of the 1.5 s was prefill
    rec["phase_seconds"]["project"] = 0.04  # of the walk's 0.1 s
    b = cost.breakdown(rec, ar_ms_per_token=50.0)
    assert b["projection_ms"] == pytest.approx(4.0)
    assert b["loop_other_ms"] == pytest.approx(140.0 - 135.0)
    assert b["prefill_ms_per_step"] == pytest.approx(10.0)
    assert b["bookkeeping_ms"] == pytest.approx(10.0 + 10.0 + 5.0 + 5.0)  # plan + walk + commit + loop
    assert b["depth_vs_head_forward"] == pytest.approx((20.0 + 10.0) / 20.0)
    ar = cost.breakdown(dict(phase_record(method="autoregressive", mean_accepted_length=1.0),
                             phase_seconds={"verify_forward": 0.5, "walk": 0.01, "commit": 0.01, "step": 0.52}),
                        ar_ms_per_token=50.0)
    table = cost.lean_checks([ar, b], ar_ms=50.0)
    assert "| autoregressive | 3.000x |" in table  # 150 ms per token against generate's 50
    assert "| rheo-m1-ot | – | 30.0 | 4.0 | 1.50x |" in table
    header, rule = table.splitlines()[:2]
    assert header.count("|") == rule.count("|")
