"""The fused cost pipeline (``kernels/plan/cpu_pipeline.plan_cost_tree``) against the pass
list it lowers: ``plan_tree`` with ``cost_pipeline`` over the numba passes, and over the
reference passes. The same linearised tree, table for table (NaN == NaN), the same cost
decision and the same draft calls, for one tree and batches, every proxy, rheostats from 0
to K, greedy and sampled laws, vocabularies below the support, per-row steps and stream
ids, and cost plans that stop before depth 1, at a depth the gate declines, or never.

Also the two pieces it runs: the numba ``expand`` and ``assign`` writing the tree they are
given (``PassContext.in_place``), and ``expand_assign`` (``assign(expand(...))`` in one call)."""

from __future__ import annotations

import random

import pytest
import torch

from _planner_helpers import LOWERING_CASES, assert_trees_equal, path_hash_draft as _draft
from rheoplan import SamplingConfig, TreeConfig, plan_tree
from rheoplan.costmodel import Calibration, CostPlan, Timings
from rheoplan.ir import empty_host_tree, empty_tree
from rheoplan.kernels.plan.cpu_pass import decide as numba_decide, frontiers as numba_frontiers
from rheoplan.kernels.plan.cpu_pipeline import plan_cost_tree
from rheoplan.kernels.slot_expansion.cpu_pass import assign, expand, expand_assign
from rheoplan.pipeline import PassContext, PassError, lower
from rheoplan.planner.assign import gumbel_sampler
from rheoplan.planner.default import DEFAULT_PIPELINE, cost_pipeline
from rheoplan.rng import Streams


def _plan(kind: str, seed: int) -> CostPlan:
    """``deep``: drafting is free and every node is believed accepted, so no gate declines;
    ``skip``: the schedule skips drafting; ``mixed``: random rates on a sloped verify
    curve, so gates decline at varying depths."""
    rnd = random.Random(seed)
    cal = Calibration()
    for c in range(len(cal.trials)):
        for b in range(len(cal.trials[c])):
            cal.trials[c][b] = rnd.uniform(0, 20) if kind == "mixed" else 40.0
            cal.accepts[c][b] = rnd.uniform(0, cal.trials[c][b]) if kind == "mixed" else 40.0
    for d in range(8):
        cal.cont_trials[d] = rnd.uniform(0, 20) if kind == "mixed" else 40.0
        cal.cont_accepts[d] = rnd.uniform(0, cal.cont_trials[d]) if kind == "mixed" else 40.0
    slope, draft = (rnd.uniform(0.05, 1.5), rnd.uniform(0.2, 3.0)) if kind == "mixed" else (0.0, 0.0)
    tm = Timings((1, 8, 64), (10.0, 10.0 + 7 * slope, 10.0 + 63 * slope), (11.0, 11.0 + 7 * slope, 11.0 + 63 * slope),
                 0, 1000, (1, 3), (draft, 1.5 * draft), 0.1 if kind == "mixed" else 0.0, 0.0)
    return CostPlan.from_calibration(tm, cal, skip_draft=kind == "skip")


CONFIGS = LOWERING_CASES + [  # and the decode's default tree
    (dict(depth=6, frontier=3, slots=3, budget=32, rheostat=1, support=128), 1.0, 300),
]


def _both(cfg, T, V, kind, seed, roots, step, keys, backend="numba"):
    tree, sampling = TreeConfig(**cfg), SamplingConfig(temperature=T)
    plan = _plan(kind, seed)
    prefix = [3 + 5 * b for b in range(len(roots))]
    runs = []
    for fused in (False, True):
        calls, seen = [], []
        draft = _draft(V, seed, calls)
        if fused:
            t = plan_cost_tree(draft, roots, tree=tree, sampling=sampling, plan=plan, prefix_len=prefix, seed=seed,
                               step=step, stream_keys=keys, on_decision=seen.append)
        else:
            numba = backend == "numba"
            passes = cost_pipeline(plan, lower(DEFAULT_PIPELINE, backend), on_decision=seen.append,
                                   decide=numba_decide if numba else None, frontiers=numba_frontiers if numba else None)
            t = plan_tree(draft, roots, tree=tree, sampling=sampling, prefix_len=prefix, seed=seed, step=step,
                          passes=passes, backend=backend, stream_keys=keys)
        runs.append((t, calls, seen))
    return runs


@pytest.mark.parametrize("kind", ["mixed", "deep", "skip"])
@pytest.mark.parametrize("cfg,T,V", CONFIGS)
def test_fused_plan_equals_the_numba_pass_list(cfg, T, V, kind):
    for seed in range(4):
        for roots, step, keys in (([5], 3, None), ([1, 2, 3], 2, None), ([4, 6], (7, 2), (9, 1))):
            (ref, ref_calls, ref_seen), (got, calls, seen) = _both(cfg, T, V, kind, seed, roots, step, keys)
            assert_trees_equal(ref, got)
            assert calls == ref_calls
            assert seen == ref_seen and len(seen) == 1


@pytest.mark.parametrize("cfg,T,V", CONFIGS[:4])
def test_fused_plan_equals_the_reference_passes(cfg, T, V):
    """The reference passes and the reference ``decide``: the same tree (the numba passes
    equal these, ``tests/rheoplan/test_lower.py``, ``test_cost_decide.py``)."""
    for seed in range(3):
        (ref, ref_calls, ref_seen), (got, calls, seen) = _both(cfg, T, V, "mixed", seed, [1, 2], 4, None,
                                                               backend="reference")
        assert_trees_equal(ref, got)
        assert calls == ref_calls and seen == ref_seen


def test_the_plans_cover_every_way_growth_ends():
    """The cases above reach a tree cut before depth 1, one whose gate declines below the
    full depth, and one grown to the full depth (the prune then decides afresh)."""
    depths = set()
    for kind in ("mixed", "deep", "skip"):
        for seed in range(4):
            (_, _, _), (t, _, _) = _both(*CONFIGS[0], kind, seed, [5], 3, None)
            depths.add((kind, t.cur_depth))
    assert ("skip", 0) in depths and ("deep", CONFIGS[0][0]["depth"]) in depths
    assert any(k == "mixed" and 0 < d < CONFIGS[0][0]["depth"] for k, d in depths), depths


def _root_tree(cfg: TreeConfig, sampling: SamplingConfig, B: int):
    return empty_tree(B, cfg.capacity, cfg.max_expanded, cfg.support, torch.arange(1, B + 1),
                      torch.tensor([4] * B), cfg.effective_rheostat(sampling), cfg.slots)


@pytest.mark.parametrize("cfg,T,V", CONFIGS)
def test_in_place_passes_write_the_given_tree_and_equal_the_copying_ones(cfg, T, V):
    """With ``in_place`` each pass writes the tables of the tree it is given (the result
    holds the same storage) and returns a new object; without, fresh tables; the same tree."""
    tree, sampling = TreeConfig(**cfg), SamplingConfig(temperature=T)
    out = {}
    for in_place in (False, True):
        t = _root_tree(tree, sampling, 2)
        ctx = PassContext(tree_cfg=tree, sampling=sampling, draft=_draft(V, 0, []),
                          sampler=gumbel_sampler(Streams(3), 1), in_place=in_place)
        for _ in range(2):
            for p, field in ((expand, "n_nodes"), (assign, "y_token")):
                before = t
                t = p(t, ctx)
                if t is before:  # assign with nothing to draw (m = K, greedy) returns its input
                    assert p is assign and tree.effective_rheostat(sampling) == tree.slots
                    continue
                same = getattr(t, field).data_ptr() == getattr(before, field).data_ptr()
                assert same == in_place, (p.__name__, field)
        out[in_place] = t
    assert_trees_equal(out[False], out[True])


@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("cfg,T,V", CONFIGS)
def test_expand_assign_equals_assign_after_expand(cfg, T, V, in_place):
    tree, sampling = TreeConfig(**cfg), SamplingConfig(temperature=T)

    def injected(b, node, qt):  # a sampler without the streams' batch interface (the oracle's)
        return int(torch.argmin(qt))

    for sampler in (gumbel_sampler(Streams(5), 2, (3, 8)), injected):
        got = {}
        for fused in (False, True):
            t = _root_tree(tree, sampling, 2)
            ctx = PassContext(tree_cfg=tree, sampling=sampling, draft=_draft(V, 1, []), sampler=sampler,
                              in_place=in_place)
            for _ in range(tree.depth):
                t = expand_assign(t, ctx) if fused else assign(expand(t, ctx), ctx)
            got[fused] = t
        assert_trees_equal(got[False], got[True])


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
@pytest.mark.parametrize("at_depth", [0, 1])
def test_a_broken_draft_row_raises_as_the_pass_lists_do(value, at_depth):
    """A draft row with a NaN or +inf logit is a broken law: the fused plan (whose check
    sits in the ranking kernel) raises the error the numba and reference pass lists
    raise, at the first depth or a later one."""
    cfg = CONFIGS[-1]
    good = _draft(300, 0)

    def broken(tree, nodes):
        out = good(tree, nodes)
        if tree.cur_depth == at_depth:
            out[0, -1, 7] = value
        return out

    tree, sampling = TreeConfig(**cfg[0]), SamplingConfig(temperature=1.0)
    kw = dict(tree=tree, sampling=sampling, prefix_len=[4], seed=1, step=0)
    plan = _plan("deep", 0)
    with pytest.raises(ValueError, match=r"draft logits contain NaN or \+inf"):
        plan_cost_tree(broken, [5], plan=plan, **kw)
    for backend in ("numba", "reference"):
        numba = backend == "numba"
        passes = cost_pipeline(plan, lower(DEFAULT_PIPELINE, backend), decide=numba_decide if numba else None,
                               frontiers=numba_frontiers if numba else None)
        with pytest.raises(PassError, match=r"expand.*draft logits contain NaN or \+inf"):  # names the pass
            plan_tree(broken, [5], passes=passes, backend=backend, **kw)


@pytest.mark.parametrize("cfg,T,V", CONFIGS)
def test_expand_assign_and_decide_through_views_equal_them_without(cfg, T, V):
    """A run that has its tree's numpy views (``empty_host_tree``) gets the same trees from
    ``expand_assign`` and the same decisions and frontiers as one reading the tensors."""
    tree, sampling = TreeConfig(**cfg), SamplingConfig(temperature=T)
    plan = _plan("mixed", 3)
    got = {}
    for with_views in (False, True):
        t, views = empty_host_tree(2, tree.capacity, tree.max_expanded, tree.support, torch.tensor([1, 2]),
                                   torch.tensor([4, 4]), tree.effective_rheostat(sampling), tree.slots)
        views = views if with_views else None
        ctx = PassContext(tree_cfg=tree, sampling=sampling, draft=_draft(V, 1, []),
                          sampler=gumbel_sampler(Streams(5), 2, (3, 8)), in_place=True)
        seen = []
        for _ in range(tree.depth):
            t = expand_assign(t, ctx, views)
            seen.append((numba_decide(plan, t, tree.budget, views), numba_frontiers(t, tree.frontier, views)))
        got[with_views] = (t, seen)
    assert_trees_equal(got[False][0], got[True][0])
    assert got[False][1] == got[True][1]


def test_views_need_a_run_that_writes_in_place():
    tree, sampling = TreeConfig(**CONFIGS[-1][0]), SamplingConfig(temperature=1.0)
    t, views = empty_host_tree(1, tree.capacity, tree.max_expanded, tree.support, torch.tensor([1]),
                               torch.tensor([4]), tree.effective_rheostat(sampling), tree.slots)
    ctx = PassContext(tree_cfg=tree, sampling=sampling, draft=_draft(300, 1, []), sampler=gumbel_sampler(Streams(5), 2))
    with pytest.raises(ValueError, match="in place"):
        expand_assign(t, ctx, views)
