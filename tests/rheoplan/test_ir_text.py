"""``rheoplan.ir_text``: the text IR and JSON round-trip exactly; floats print short."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from _planner_helpers import PathDraft, Words, assert_trees_equal, planning_problems
from rheoplan import SamplingConfig, TreeConfig, plan_tree
from rheoplan.ir_text import fmt_float, from_json, from_text, parse_float, to_json, to_text
from rheoplan.pipeline import PassContext, run_pipeline
from rheoplan.planner.default import DEFAULT_PIPELINE


@given(st.floats(width=32, allow_nan=True))
@settings(max_examples=300)
def test_floats_print_short_and_read_back_exactly(x):
    s = fmt_float(x)
    y = parse_float(s)
    assert (x != x and y != y) or torch.tensor(y, dtype=torch.float32).view(torch.int32) == \
        torch.tensor(x, dtype=torch.float32).view(torch.int32)


def test_float_text_is_readable():
    assert [fmt_float(x) for x in (0.1, 1.0, 0.0, -0.5, float("-inf"), 1e-30)] == \
        ["0.1", "1", "0", "-0.5", "-inf", "1e-30"]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(planning_problems(), st.booleans(), st.integers(0, 3))
def test_text_round_trip_after_every_pass(problem, with_tokenizer, stop):
    """Exact parse-back at every stage: pending tokens, NaN scores, pruned, linearised."""
    draft, cfg, sampling, roots, seed = problem
    from rheoplan.ir import empty_tree
    from rheoplan.planner.assign import gumbel_sampler
    from rheoplan.rng import Streams

    m = cfg.effective_rheostat(sampling)
    t0 = empty_tree(len(roots), cfg.capacity, cfg.max_expanded, cfg.support, torch.tensor(roots),
                    torch.tensor([4] * len(roots)), m, cfg.slots)
    ctx = PassContext(tree_cfg=cfg, sampling=sampling, draft=draft, sampler=gumbel_sampler(Streams(seed), 0))
    from rheoplan.pipeline import flatten
    passes = [p for _, p in flatten(DEFAULT_PIPELINE, ctx)]
    # stop after expand@1, assign@1, prune or linearize
    stops = [1, 2, len(passes) - 1, len(passes)]
    t = run_pipeline(passes[: stops[stop]], t0, ctx)
    tok = Words() if with_tokenizer else None
    text = to_text(t, tokenizer=tok)
    back = from_text(text)
    assert to_text(back, tokenizer=tok) == text
    assert_trees_equal(back, t)
    assert_trees_equal(from_json(to_json(t)), t)


def test_text_has_one_line_per_node_and_the_documented_fields():
    cfg = TreeConfig(depth=2, frontier=1, slots=2, budget=2, rheostat=1, support=4)
    t = plan_tree(PathDraft([[2.0, 1.0, 0.0, -1.0]]), [3], tree=cfg, sampling=SamplingConfig())
    lines = to_text(t, tokenizer=Words()).splitlines()
    assert lines[0] == ("draft_tree B=1 capacity=5 max_expanded=2 support=4 cur_depth=2 rheostat=1 slots=2 "
                        "sup_width=4")
    assert lines[1] == "tree 0 prefix_len=0 n_nodes=5 n_expanded=2"
    assert lines[2].startswith('  %0 = ROOT depth=0 token=3 "cat\\n" q=1 w=1 score=0 kept expanded row=0')
    assert lines[3].startswith("  %1 = DET parent=%0 depth=1 slot=0 token=0 \"the\" q=0.6")
    assert any(ln.startswith("  row 0 node=%0 n=4 z=") and "Y=" in ln and "q~(Y)=" in ln for ln in lines)
    assert any(ln.startswith("    support 0:") for ln in lines)
    assert any(ln.startswith("linear L=3 W=1") for ln in lines)
    assert any(ln.startswith("  @1 = %1 token=0 pos=1 parent=@0") for ln in lines)


def test_parse_errors_name_the_line():
    good = to_text(plan_tree(PathDraft([[2.0, 1.0, 0.0]]), [0], sampling=SamplingConfig(),
                             tree=TreeConfig(depth=1, frontier=1, slots=2, budget=2, support=3)))
    with pytest.raises(ValueError, match="header"):
        from_text("tree 0 prefix_len=0")
    broken = good.replace(" q=1 ", " ", 1)
    with pytest.raises(ValueError, match="line 3"):
        from_text(broken)
