"""The prompt plan: size, diversity, determinism, and evaluation prompts kept out."""

from __future__ import annotations

from collections import Counter

import pytest

from rheoplan.train import prompts as pr
from rheoplan.train import selfdistill as sd
from rheoplan.train.cli import build_parser

FILE = sd.read_prompts(sd.data_file("prompts_train.txt"))
HELD = [t for _, t in sd.read_prompts(sd.data_file("prompts_heldout.txt"))]


@pytest.fixture(scope="module")
def default_plan():
    """The plan `rheoplan train-draft` samples with its defaults (the committed shards)."""
    n = build_parser().get_default("prompts")
    return pr.build_plan(seed=0, n_generated=n, file_prompts=FILE, heldout=HELD)


@pytest.mark.slow
def test_no_planned_prompt_equals_or_nears_a_heldout_prompt(default_plan):
    for p in default_plan:
        for h in HELD:
            assert not pr.near_duplicate(p.text, h), (p.text, h)


def test_a_heldout_prompt_slipped_into_the_training_file_is_dropped():
    """Mutation control for the check above: the exclusion does fire."""
    leaked = [("chat", HELD[1]), ("chat", "Why does ice float on WATER??"), ("code", HELD[10] + " Add comments.")]
    plan = pr.build_plan(n_generated=0, file_prompts=FILE[:5] + leaked, heldout=HELD)
    assert [p.text for p in plan] == [t for _, t in FILE[:5]]


@pytest.mark.parametrize("a, b, near", [
    ("Why does ice float on water?", "why does ice float on water", True),
    ("Summarize this: Penguins are flightless birds that live in the south.",
     "Give a short summary of this passage: penguins are flightless birds that live in the south", True),
    ("What is 31 times 7? Show your work.", "What is 17 times 23? Show your work.", False),
    ("Write a Python function that reverses a string.", "Write a Python function that checks whether a year "
     "is a leap year.", False),
])
def test_near_duplicate(a, b, near):
    assert pr.near_duplicate(a, b) is near


@pytest.mark.slow
def test_plan_is_large_diverse_and_deterministic(default_plan):
    assert len(default_plan) >= 7000
    gen = [pr._norm(p.text) for p in default_plan if p.source == "generated"]
    assert len(set(gen)) == len(gen) and not set(gen) & {pr._norm(t) for _, t in FILE}  # all new
    cats = Counter(p.category for p in default_plan)
    assert set(cats) == {"chat", "instructions", "code", "math", "summarisation"}
    assert min(cats.values()) >= 150
    assert sum(p.source == "file" for p in default_plan) >= 280  # the shipped set is in the plan
    again = pr.build_plan(seed=0, n_generated=200, file_prompts=FILE, heldout=HELD)
    assert pr.plan_digest(again) == pr.plan_digest(pr.build_plan(seed=0, n_generated=200, file_prompts=FILE,
                                                                 heldout=HELD))
    other = pr.build_plan(seed=1, n_generated=200, file_prompts=FILE, heldout=HELD)
    assert pr.plan_digest(other) != pr.plan_digest(again)


@pytest.mark.slow
def test_about_one_in_four_first_turns_gets_a_follow_up(default_plan):
    share = sum(pr.has_follow_up(p.id) for p in default_plan) / len(default_plan)
    assert 0.2 < share < 0.3
    assert {pr.follow_up(p.id) for p in default_plan} == set(pr.FOLLOW_UPS)


def test_bad_sizes_are_rejected():
    with pytest.raises(ValueError, match="n_generated"):
        pr.build_plan(n_generated=-1)
