"""``rheoplan.dump``: the text IR round-trips exactly; JSON, DOT, networkx and PNG work."""

from __future__ import annotations

from dataclasses import fields

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from _planner_helpers import PathDraft, planning_problems
from rheoplan import SamplingConfig, TreeConfig, plan_tree
from rheoplan.dump import fmt_float, from_json, from_text, parse_float, to_dot, to_json, to_networkx, to_text
from rheoplan.pipeline import PassContext, run_pipeline
from rheoplan.planner.default import DEFAULT_PIPELINE


class Words:
    words = ["the", "a", 'say "hi"', "cat\n", "é", "=x", "%1", "  "]

    def decode(self, ids):
        return "".join(self.words[i % len(self.words)] for i in ids)


def assert_trees_equal(a, b):
    for f in fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if f.name == "linear":
            assert (x is None) == (y is None)
            if x is not None:
                for g in fields(x):
                    assert torch.equal(getattr(x, g.name), getattr(y, g.name)), g.name
        elif isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and x.shape == y.shape, f.name
            same = (x == y) | (torch.isnan(x) & torch.isnan(y)) if x.is_floating_point() else x == y
            assert bool(same.all()), f.name
        else:
            assert x == y, f.name


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


@pytest.fixture(scope="module")
def pruned_tree():
    cfg = TreeConfig(depth=3, frontier=2, slots=3, budget=4, rheostat=1, support=6)
    draft = PathDraft([[0.5, 0.1, 1.0, -0.3, 0.0, 0.7], [1.0, 1.0, 0.0, 0.0, -1.0, 2.0], [3, 0, 0, 0, 0, 0]])
    return plan_tree(draft, [1, 2], tree=cfg, sampling=SamplingConfig(), seed=11)


def test_dot_styles_kinds_pruned_and_phantoms(pruned_tree):
    dot = to_dot(pruned_tree, tokenizer=Words())
    assert dot.startswith("digraph draft_tree {") and dot.rstrip().endswith("}")
    assert "cluster_0" in dot and "cluster_1" in dot
    assert "shape=doublecircle" in dot and "shape=ellipse" in dot  # ROOT, SAMPLED
    assert 'style="filled,dashed"' in dot  # pruned
    has_phantom = any(int(pruned_tree.y_node[b, r]) >= 0 and not pruned_tree.kept[b, int(pruned_tree.y_node[b, r])]
                      and pruned_tree.kept[b, int(pruned_tree.exp_node[b, r])]
                      for b in range(2) for r in range(int(pruned_tree.n_expanded[b])))
    assert has_phantom and "(phantom)" in dot
    assert dot.count(" -> ") == int(pruned_tree.n_nodes.sum()) - 2


def test_networkx_graph_has_node_attributes(pruned_tree):
    g = to_networkx(pruned_tree, b=1)
    n = int(pruned_tree.n_nodes[1])
    assert g.number_of_nodes() == n and g.number_of_edges() == n - 1
    assert g.nodes[0]["kind"] == "ROOT" and "z" in g.nodes[0]
    assert {a["kind"] for _, a in g.nodes(data=True)} == {"ROOT", "DET", "SAMPLED", "PAD"}
    assert sum(a["kept"] for _, a in g.nodes(data=True)) == 5
    assert all(g.nodes[v]["pruned"] != g.nodes[v]["kept"] for v in g.nodes)


def test_draw_png_writes_an_image(pruned_tree, tmp_path):
    from rheoplan.dump import draw_png, tree_layout

    assert tree_layout([-1, 0, 0]) == {1: (0.0, -1.0), 2: (1.0, -1.0), 0: (0.5, 0.0)}
    path = tmp_path / "tree.png"
    draw_png(pruned_tree, path, tokenizer=Words(), b=0)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
