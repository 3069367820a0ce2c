"""``rheoplan.bench.phases.breakdown``: a benchmark record's step time by phase and the
accepted length that would break even (``bench cost`` and ``bench decode`` both use it;
the lean-step split into loop and prefill is tested with ``bench cost``'s table)."""

from __future__ import annotations

import pytest

from _bench_models import phase_record
from rheoplan.bench import phases


def test_breakdown_break_even_tau():
    b = phases.breakdown(phase_record(), ar_ms_per_token=50.0)
    assert b["step_ms"] == pytest.approx(150.0)
    assert b["phase_ms"]["verify_forward"] == pytest.approx(90.0)
    assert b["phase_ms"]["other"] == pytest.approx(150.0 - 135.0)  # wall time outside the phases
    assert sum(b["phase_ms"].values()) == pytest.approx(b["step_ms"])
    assert b["ms_per_token"] == pytest.approx(75.0)
    assert b["break_even_tau"] == pytest.approx(3.0)  # 150 ms per step / 50 ms per AR token
    assert b["tau_for_1_3x"] == pytest.approx(3.9)


def test_breakdown_rejects_empty_runs():
    with pytest.raises(ValueError, match="steps >= 1"):
        phases.breakdown(phase_record(steps=0), 50.0)
    with pytest.raises(ValueError, match="ar_ms_per_token > 0"):
        phases.breakdown(phase_record(), 0.0)
