"""``examples/plan_replay.py``: the plans recorded from a decode replay to the same trees
(a decode with a cost model, functional models), and a changed draft answer is caught."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

from rheoplan import SamplingConfig, TreeConfig
from rheoplan.costmodel import CostModel, Timings
from rheoplan.decode import plan_and_decode
from rheoplan.models.functional import hashed_context_lm

EX = runpy.run_path(str(Path(__file__).resolve().parents[2] / "examples" / "plan_replay.py"), run_name="example")


def _records():
    tgt, drf = hashed_context_lm(12, seed=1, sharpness=2.0), hashed_context_lm(12, seed=2, sharpness=2.0)
    cost = CostModel(Timings((1, 64), (10.0, 12.0), (12.0, 14.0), 0, 1000, (1, 4), (0.5, 1.0), 0.5, 0.5))
    cfg = TreeConfig(depth=3, frontier=2, slots=3, budget=6, support=12)
    with EX["recording"]() as records:
        plan_and_decode(tgt, drf, [0, 1, 2], max_new_tokens=12, tree=cfg, sampling=SamplingConfig(temperature=1.0),
                        seed=3, cost_model=cost)
    return records


def test_replayed_plans_are_the_recorded_trees():
    records = _records()
    assert records and any(len(answers) > 1 for _, _, answers, _ in records)  # some steps drafted deeper
    # the steps' plans are the fused cost pipeline's (a process's first decode also plans a
    # tiny warm-up tree through plan_tree)
    assert sum("plan" in kw for _, kw, _, _ in records) >= max(1, len(records) - 1)
    EX["check"](records)
    assert EX["replay"](records) > 0


def test_a_changed_draft_answer_is_caught():
    records = _records()
    i = next(i for i, (_, _, answers, _) in enumerate(records) if answers)
    roots, kw, answers, lin = records[i]
    answers[0] = answers[0].flip(-1)  # another law for the first depth: another tree
    with pytest.raises(ValueError, match=f"step {i}: the replayed tree differs"):
        EX["check"](records)
