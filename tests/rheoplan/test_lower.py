"""``lower(DEFAULT_PIPELINE, backend)``: the numba and Triton passes build exactly the
reference passes' DraftTree (every tensor equal, NaN == NaN) for the same seed: batch > 1,
all proxies, rheostats, greedy, a custom (injected) sampler, and vocabularies smaller
than the support. A pass of your own stays as written between lowered built-ins.

Triton runs under the interpreter here (tests/conftest.py): small cases by default, the
larger ones marked slow."""

from __future__ import annotations

import pytest
import torch

from _planner_helpers import LOWERING_CASES as CASES, assert_trees_equal, path_hash_draft as make_draft
from rheoplan import SamplingConfig, TreeConfig, plan_tree
from rheoplan.pipeline import FnPass, PassContext, Repeat, flatten, lower
from rheoplan.planner.default import DEFAULT_PIPELINE


def _cases():
    """numba for every case; triton (interpreter) for the first three, the rest slow."""
    for i, c in enumerate(CASES):
        yield pytest.param(*c, "numba")
        yield pytest.param(*c, "triton", marks=[pytest.mark.interpreter] + ([pytest.mark.slow] if i >= 3 else []))


@pytest.mark.parametrize("cfg,T,V,backend", list(_cases()))
def test_lowered_pipeline_equals_reference(cfg, T, V, backend):
    tree, sampling = TreeConfig(**cfg), SamplingConfig(temperature=T)
    draft = make_draft(V, seed=V)
    kw = dict(tree=tree, sampling=sampling, prefix_len=[3, 0, 7], seed=11, step=2)
    ref = plan_tree(draft, [1, 2, 3], backend="reference", **kw)
    ker = plan_tree(draft, [1, 2, 3], backend=backend, **kw)
    assert_trees_equal(ref, ker)


@pytest.mark.parametrize("backend", ["numba", pytest.param("triton", marks=pytest.mark.interpreter)])
def test_injected_sampler_path(backend):
    """A sampler without the batch interface (the oracle's injection) is called per row."""
    tree, sampling = TreeConfig(depth=3, frontier=2, slots=4, budget=8, support=12), SamplingConfig()
    draft = make_draft(25, seed=1)
    calls = []

    def sampler(b, node, qt):
        calls.append((b, node))
        return int(torch.argmin(qt))  # deterministic and unlike Gumbel-max

    ref = plan_tree(draft, [4, 5], tree=tree, sampling=sampling, sampler=sampler, backend="reference")
    n_ref = len(calls)
    ker = plan_tree(draft, [4, 5], tree=tree, sampling=sampling, sampler=sampler, backend=backend)
    assert len(calls) == 2 * n_ref
    assert_trees_equal(ref, ker)


def test_lower_swaps_builtins_and_keeps_names():
    ctx = PassContext(tree_cfg=TreeConfig(depth=3), sampling=SamplingConfig())
    names = [n for n, _ in flatten(DEFAULT_PIPELINE, ctx)]
    for backend in ("reference", "numba", "triton"):
        low = flatten(lower(DEFAULT_PIPELINE, backend), ctx)
        assert [n for n, _ in low] == names
        mods = {p.fn.__module__ for _, p in low}
        want = {"reference": "rheoplan.planner", "numba": "cpu_pass", "triton": "triton_pass"}[backend]
        assert all(want in m for m in mods), mods
    # lowering a lowered list starts again from the reference implementations
    again = flatten(lower(lower(DEFAULT_PIPELINE, "numba"), "reference"), ctx)
    assert [p.fn for _, p in again] == [p.fn for _, p in flatten(DEFAULT_PIPELINE, ctx)]


def test_lower_keeps_a_user_pass_and_lowers_around_it():
    """docs/custom_pass.md: a pass of your own after prune; the built-ins stay fast."""
    def drop_nothing(tree, ctx):
        return tree

    mine = FnPass("drop_nothing", drop_nothing)
    passes = []
    for p in DEFAULT_PIPELINE:
        passes.append(p)
        if getattr(p, "name", None) == "prune":
            passes.append(mine)
    low = lower(passes, "numba")
    assert isinstance(low[0], Repeat) and all("cpu_pass" in p.fn.__module__ for p in low[0].body)
    assert low[2] is mine
    assert "cpu_pass" in low[1].fn.__module__ and "cpu_pass" in low[3].fn.__module__
    cfg = TreeConfig(depth=2, frontier=2, slots=3, budget=4, support=8)
    draft = make_draft(20, seed=3)
    kw = dict(tree=cfg, sampling=SamplingConfig(), seed=5)
    assert_trees_equal(plan_tree(draft, [1], passes=passes, backend="reference", **kw),
                       plan_tree(draft, [1], passes=passes, backend="numba", **kw))


@pytest.mark.parametrize("bad", ["cuda", "Numba", "", None, 3])
def test_bad_backend_names_the_parameter(bad):
    draft = make_draft(8, seed=0)
    with pytest.raises(ValueError, match=r"backend=.*'auto', 'reference', 'numba', 'triton'"):
        plan_tree(draft, [1], tree=TreeConfig(depth=1, slots=2, budget=2, support=8),
                  sampling=SamplingConfig(), backend=bad)
    with pytest.raises(ValueError, match="backend="):
        lower(DEFAULT_PIPELINE, bad)


def test_triton_without_cuda_or_interpreter_fails_first(monkeypatch):
    from rheoplan.backends import resolve_backend

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        resolve_backend("triton", "cpu")
    assert resolve_backend("auto", "cpu") == "numba"
