"""examples/compare_heads.py prices every head's verify forwards with one curve (the
target's, measured once) and keeps each head's own draft and bookkeeping latencies."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from rheoplan.costmodel import Calibration, CostModel, Timings

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "compare_heads.py"


def _load():
    spec = importlib.util.spec_from_file_location("compare_heads", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_shared_curve_takes_the_reference_curve_and_keeps_the_heads_own_latencies():
    mod = _load()
    ref = CostModel(Timings((1, 16), (20.0, 30.0), (25.0, 40.0), 64, 512, (1,), (2.0,), 5.0, 3.0))
    prior = Calibration()
    own = CostModel(Timings((1, 2, 16), (34.0, 34.0, 34.0), (35.0, 36.0, 37.0), 32, 256, (1, 3), (2.6, 2.0),
                            5.6, 3.5, overhead_depth_ms=1.0), prior, ())
    out = mod.shared_curve(own, ref)
    t = out.timings
    assert (t.sizes, t.verify_lo, t.verify_hi, t.ctx_lo, t.ctx_hi) == ((1, 16), (20.0, 30.0), (25.0, 40.0), 64, 512)
    assert (t.draft_widths, t.draft_ms, t.overhead_ms, t.ar_overhead_ms, t.overhead_depth_ms) == \
        ((1, 3), (2.6, 2.0), 5.6, 3.5, 1.0)
    assert out.calibration is prior and own.timings.verify_lo == (34.0, 34.0, 34.0)  # the input is unchanged
