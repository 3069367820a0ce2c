"""The pass pipeline and its instruments; RHEOPLAN_DEBUG levels."""

from __future__ import annotations

import io

import pytest
import torch

from _planner_helpers import PathDraft
from rheoplan import SamplingConfig, TreeConfig, plan_tree
from rheoplan.ir_text import from_text, to_text
from rheoplan.pipeline import (DumpIR, FnPass, Instrument, PassError, PassTiming, PrintAfterAll, Repeat,
                               VerifyAfterEach, debug_instruments)
from rheoplan.planner.default import DEFAULT_PIPELINE

CFG = TreeConfig(depth=2, frontier=2, slots=3, budget=4, rheostat=1, support=5)
DRAFT = PathDraft([[0.5, 0.1, 1.0, -0.3, 0.0], [1.0, 1.0, 0.0, 0.0, -1.0]])


def plan(**kw):
    return plan_tree(DRAFT, [1], tree=CFG, sampling=SamplingConfig(), **kw)


def test_print_after_all_prints_every_pass_in_order():
    out = io.StringIO()
    plan(instruments=[PrintAfterAll(stream=out)])
    text = out.getvalue()
    headers = [ln for ln in text.splitlines() if ln.startswith("# ---- after")]
    assert headers == ["# ---- after 001 expand@1 ----", "# ---- after 002 assign@1 ----",
                       "# ---- after 003 expand@2 ----", "# ---- after 004 assign@2 ----",
                       "# ---- after 005 prune ----", "# ---- after 006 linearize ----"]
    assert "linear L=5" in text.split("# ---- after 006")[1]


def test_dump_ir_writes_numbered_parseable_files(tmp_path):
    plan(instruments=[DumpIR(tmp_path)], step=3)
    files = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.txt"))
    assert files == ["step0003/001_expand_d1.txt", "step0003/002_assign_d1.txt", "step0003/003_expand_d2.txt",
                     "step0003/004_assign_d2.txt", "step0003/005_prune.txt", "step0003/006_linearize.txt"]
    final = from_text((tmp_path / "step0003/006_linearize.txt").read_text())
    assert final.linear is not None and int(final.linear.n[0]) == 5


def test_pass_timing_counts_each_pass():
    timing = PassTiming()
    plan(instruments=[timing])
    plan(instruments=[timing], step=1)
    assert timing.counts == {"expand": 4, "assign": 4, "prune": 2, "linearize": 2}
    assert all(v >= 0 for v in timing.totals.values())
    assert "expand" in timing.summary() and "ms" in timing.summary()


def corrupt(tree, ctx):
    t = tree.clone()
    t.kept[:, :] = False  # drops the root: ill-formed
    return t


def test_verify_after_each_names_the_broken_pass_and_its_predecessors():
    passes = list(DEFAULT_PIPELINE[:2]) + [FnPass("corrupt", corrupt), DEFAULT_PIPELINE[-1]]
    with pytest.raises(PassError) as err:
        plan(passes=passes, instruments=[VerifyAfterEach()])
    msg = str(err.value)
    assert "after pass 'corrupt'" in msg and "'expand@2', 'assign@2', 'prune'" in msg
    assert "root is not kept" in msg


def test_a_crashing_pass_is_named_with_history():
    def crash(tree, ctx):
        raise RuntimeError("boom")

    with pytest.raises(PassError, match=r"pass 'crash' failed after \['expand@1', 'assign@1'\].*boom"):
        plan(passes=[Repeat("grow", DEFAULT_PIPELINE[0].body, times=lambda ctx: 1), FnPass("crash", crash)])


def test_suite_fixture_lints_every_pass():
    """The autouse fixture in tests/conftest.py adds VerifyAfterEach to every run."""
    from rheoplan import pipeline

    assert any(isinstance(i, VerifyAfterEach) for i in pipeline.debug_instruments())
    with pytest.raises(PassError, match="corrupt"):
        plan(passes=[*DEFAULT_PIPELINE[:2], FnPass("corrupt", corrupt)])


@pytest.mark.no_ir_lint
@pytest.mark.parametrize("level, kinds", [
    ("0", []), ("1", [PassTiming]), ("2", [PassTiming, VerifyAfterEach]),
    ("3", [PassTiming, VerifyAfterEach, PrintAfterAll]),
    ("4", [PassTiming, VerifyAfterEach, PrintAfterAll, DumpIR]),
])
def test_debug_levels_select_instruments(monkeypatch, level, kinds):
    monkeypatch.setenv("RHEOPLAN_DEBUG", level)
    assert [type(i) for i in debug_instruments()] == kinds


@pytest.mark.no_ir_lint
def test_debug_level_4_prints_times_and_dumps(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("RHEOPLAN_DEBUG", "4")
    monkeypatch.setenv("RHEOPLAN_DUMP_DIR", str(tmp_path))
    plan()
    out, err = capsys.readouterr()
    assert "# ---- after 006 linearize ----" in out
    assert "pass timing:" in err
    assert (tmp_path / "step0000" / "005_prune.txt").exists()


@pytest.mark.no_ir_lint
@pytest.mark.parametrize("raw, message", [("x", "not an int"), ("7", "out of range")])
def test_bad_debug_level_is_named(monkeypatch, raw, message):
    monkeypatch.setenv("RHEOPLAN_DEBUG", raw)
    with pytest.raises(ValueError, match=f"RHEOPLAN_DEBUG.*{message}"):
        debug_instruments()


def test_passes_are_pure():
    seen = []

    class Snapshot(VerifyAfterEach):
        def before_pass(self, index, name, tree, ctx):
            seen.append((tree, to_text(tree)))

    plan(instruments=[Snapshot()])
    assert all(to_text(t) == text for t, text in seen), "a pass mutated its input tree"


def test_plan_tree_rejects_empty_roots():
    with pytest.raises(ValueError, match="root_tokens is empty"):
        plan_tree(DRAFT, torch.tensor([], dtype=torch.int64), tree=CFG, sampling=SamplingConfig())


def test_a_repeat_stops_at_a_fixpoint():
    """An iteration of a ``Repeat`` that returns the tree it started from ends the block
    (its passes are pure: the next iterations would return it too); an iteration that
    changes the tree does not."""
    calls = []

    def grow_once(tree, ctx):
        calls.append(tree.cur_depth)
        return tree.replace(cur_depth=1) if tree.cur_depth == 0 else tree

    seen = []

    class Names(Instrument):
        def after_pass(self, index, name, tree, ctx):
            seen.append((index, name))

    tail = FnPass("tail", lambda t, ctx: t)
    passes = [Repeat("grow", (FnPass("g", grow_once), FnPass("same", lambda t, ctx: t)), times=lambda ctx: 5), tail]
    out = plan(passes=passes, instruments=[Names()])
    assert out.cur_depth == 1
    assert calls == [0, 1]  # iteration 1 changed the tree, iteration 2 did not: no third
    assert seen == [(1, "g@1"), (2, "same@1"), (3, "g@2"), (4, "same@2"), (5, "tail")]


def test_the_cost_gate_ends_growth_where_it_declines():
    """With the numba passes, a depth the cost gate declines ends the ``grow`` block:
    no later expand or assign runs, and the tree is the one running every depth gives."""
    from rheoplan.costmodel import Calibration, CostPlan, Timings
    from rheoplan.pipeline import lower
    from rheoplan.planner.default import cost_pipeline

    # verify tokens cost 10 ms each past the first: a depth never pays after the first
    steep = Timings((1, 64), (10.0, 640.0), (10.0, 640.0), 0, 1000, (1,), (0.1,), 0.0, 0.0)
    plan_ = CostPlan.from_calibration(steep, Calibration())
    cfg = TreeConfig(depth=4, frontier=2, slots=3, budget=8, rheostat=1, support=5)
    history = []

    class Names(Instrument):
        def after_pass(self, index, name, tree, ctx):
            history.append(name)

    fast = plan_tree(DRAFT, [1], tree=cfg, sampling=SamplingConfig(), backend="numba", instruments=[Names()],
                     passes=cost_pipeline(plan_, lower(DEFAULT_PIPELINE, "numba")))
    assert history == ["expand@1", "assign@1", "expand@2", "assign@2", "prune", "linearize"]
    ref = plan_tree(DRAFT, [1], tree=cfg, sampling=SamplingConfig(), backend="reference",
                    passes=cost_pipeline(plan_))
    assert fast.cur_depth == ref.cur_depth == 1
    assert torch.equal(fast.kept, ref.kept) and torch.equal(fast.linear.token, ref.linear.token)
