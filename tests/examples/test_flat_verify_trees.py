"""examples/flat_verify_trees.py changes only the verify price the planner reads: the
reference curve, or its one-token latency at every size up to ``flat``; each configuration
keeps its own draft and bookkeeping latencies and its calibration."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

from rheoplan.costmodel import Calibration, CostModel, Timings

EX = runpy.run_path(str(Path(__file__).resolve().parents[2] / "examples" / "flat_verify_trees.py"), run_name="example")


REF = CostModel(Timings((1, 8, 64), (20.0, 24.0, 75.0), (22.0, 27.0, 90.0), 64, 512, (1,), (2.0,), 5.0, 3.0))
OWN_CAL = Calibration()
OWN = CostModel(Timings((1, 2), (34.0, 35.0), (36.0, 37.0), 32, 256, (1, 12), (2.6, 1.7), 5.6, 3.5,
                        overhead_depth_ms=0.8), OWN_CAL, ())


def test_flat_curve_is_the_one_token_latency_up_to_flat():
    out = EX["priced"](OWN, REF, 128)
    t = out.timings
    assert t.sizes == (1, 2, 4, 8, 16, 32, 64, 128)
    assert set(t.verify_lo) == {20.0} and set(t.verify_hi) == {22.0}
    assert (t.ctx_lo, t.ctx_hi) == (64, 512)
    assert t.verify(128, 64) == 20.0 and t.verify(100, 512) == 22.0
    # the configuration's own draft and bookkeeping latencies and calibration stay
    assert (t.draft_widths, t.draft_ms, t.overhead_ms, t.ar_overhead_ms, t.overhead_depth_ms) == \
        ((1, 12), (2.6, 1.7), 5.6, 3.5, 0.8)
    assert out.calibration is OWN_CAL


def test_flat_zero_keeps_the_reference_curve():
    t = EX["priced"](OWN, REF, 0).timings
    assert (t.sizes, t.verify_lo, t.verify_hi) == ((1, 8, 64), (20.0, 24.0, 75.0), (22.0, 27.0, 90.0))
    assert t.verify(64, 64) == 75.0


@pytest.mark.parametrize("text", ["6/3/3/32", "6/3/3/32/0/1", "6/3/x/32/0", "0/3/3/32/0", "6/3/3/32/-1"])
def test_a_bad_configuration_is_refused(text):
    with pytest.raises(ValueError, match="depth/frontier/slots/budget/flat"):
        EX["parse_config"](text)


def test_a_configuration_parses():
    assert EX["parse_config"]("10/12/12/128/64") == (10, 12, 12, 128, 64)
