"""examples/batch_phases.py splits a decode's wall time into the prefill forwards, the step
forwards and the rest per step."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "batch_phases.py"


def test_the_prefill_ends_at_the_first_one_token_forward():
    split = runpy.run_path(str(EXAMPLE))["split_forwards"]
    # two prefill forwards (length groups), a one-token step, a tree step of 7 tokens, a step
    spans = [(0.0, 0.1, 40), (0.1, 0.2, 9), (0.2, 0.23, 1), (0.25, 0.30, 7), (0.31, 0.34, 1)]
    r = split(spans, 0.5)
    assert (r["prefill_forwards"], r["steps"]) == (2, 3)
    assert r["prefill_s"] == pytest.approx(0.2) and r["step_s"] == pytest.approx(0.11)
    assert r["outside_ms"] == pytest.approx(1e3 * (0.5 - 0.31) / 3)
    # a decode with no one-token forward is all prefill
    r = split([(0.0, 0.1, 5)], 0.2)
    assert (r["prefill_forwards"], r["steps"]) == (1, 0) and r["outside_ms"] == pytest.approx(100.0)
