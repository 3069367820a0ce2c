"""Reproducibility of ``plan_and_decode`` from one seed (docs/method.md §5, "Randomness"):
same seed -> same tokens (FunctionalLM and HF); different seeds differ; and the kernel-
backed CPU planner (``passes=None`` -> ``kernel_pipeline('cpu')``) gives the same tokens
as the reference passes (``DEFAULT_PIPELINE``)."""

from __future__ import annotations

import pytest
import torch

from _decode_models import tiny_llama
from rheoplan import SamplingConfig, TreeConfig
from rheoplan.decode import _default_passes, plan_and_decode
from rheoplan.models.functional import hashed_context_lm
from rheoplan.planner.default import DEFAULT_PIPELINE

CFGS = {
    "ot_m1": (TreeConfig(depth=3, frontier=2, slots=3, budget=6, rheostat=1, support=8, verifier="ot"),
              SamplingConfig(temperature=1.0)),
    "rheo_m0_topp": (TreeConfig(depth=4, frontier=3, slots=2, budget=8, rheostat=0, support=6, verifier="rheo",
                                proxy="next_rank"), SamplingConfig(temperature=0.7, top_p=0.9)),
    "onehot_eagle": (TreeConfig.eagle(depth=3, frontier=2, slots=3, budget=6, support=8),
                     SamplingConfig(temperature=1.3, top_k=5)),
    "true_q": (TreeConfig(depth=3, frontier=2, slots=4, budget=7, rheostat=2, support=8, proxy="true_q"),
               SamplingConfig(temperature=1.0)),
    "chain": (TreeConfig.chain(depth=3, support=8), SamplingConfig(temperature=1.0)),
}


# Tiny forwards on a shared 2-core machine: one intra-op thread is ~5x faster than many.
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _functional():
    return hashed_context_lm(8, seed=31, sharpness=1.5), hashed_context_lm(8, seed=32, sharpness=1.5)


def _run(tgt, drf, cfg, s, seed, passes=None, n=30, prompt=(0, 1, 2)):
    return plan_and_decode(tgt, drf, list(prompt), max_new_tokens=n, tree=cfg, sampling=s, seed=seed,
                           passes=passes)


@pytest.mark.parametrize("name", sorted(CFGS))
def test_same_seed_same_tokens_functional(name):
    cfg, s = CFGS[name]
    tgt, drf = _functional()
    a = _run(tgt, drf, cfg, s, 42)
    tgt2, drf2 = _functional()  # fresh models too: nothing is carried in model state
    b = _run(tgt2, drf2, cfg, s, 42)
    assert a.tokens == b.tokens
    assert [(x.accepted, x.tree_size) for x in a.steps] == [(x.accepted, x.tree_size) for x in b.steps]


@pytest.mark.parametrize("name", sorted(CFGS))
def test_different_seeds_differ_functional(name):
    cfg, s = CFGS[name]
    tgt, drf = _functional()
    outs = {tuple(_run(tgt, drf, cfg, s, seed).tokens) for seed in range(5)}
    assert len(outs) >= 4  # 30 tokens over 8 symbols at T ~ 1: collisions are all but impossible


def test_same_seed_same_tokens_hf():
    target, draft = tiny_llama(41, vocab=16, layers=2, head_scale=2.0), tiny_llama(42, vocab=16, head_scale=2.0)
    cfg = TreeConfig(depth=3, frontier=2, slots=3, budget=6, rheostat=1, support=16)
    s = SamplingConfig(temperature=1.0)
    a = [_run(target, draft, cfg, s, seed, n=20).tokens for seed in (3, 4)]
    b = [_run(target, draft, cfg, s, seed, n=20).tokens for seed in (3, 4)]
    assert a == b
    assert a[0] != a[1]
    # autoregressive too
    assert _run(target, None, cfg, s, 3, n=10).tokens == _run(target, None, cfg, s, 3, n=10).tokens


def _kernel_pipeline_or_xfail():
    try:
        passes = _default_passes()
    except Exception as exc:  # a kernel pipeline that fails to build is a failure to report
        pytest.xfail(f"kernels.pipeline.kernel_pipeline('cpu') failed to build: {exc!r}")
    if passes is None:
        pytest.xfail("rheoplan.kernels.pipeline is not importable: passes=None falls back to the "
                     "reference planner, so there is nothing to compare")
    return passes


@pytest.mark.parametrize("name", sorted(CFGS))
def test_kernel_pipeline_matches_reference_functional(name):
    _kernel_pipeline_or_xfail()
    cfg, s = CFGS[name]
    tgt, drf = _functional()
    for seed in (0, 1, 2):
        kernel = _run(tgt, drf, cfg, s, seed, passes=None)
        ref = _run(tgt, drf, cfg, s, seed, passes=DEFAULT_PIPELINE)
        assert kernel.tokens == ref.tokens, (name, seed)
        assert [x.tree_size for x in kernel.steps] == [x.tree_size for x in ref.steps]


def test_kernel_pipeline_matches_reference_hf():
    _kernel_pipeline_or_xfail()
    target, draft = tiny_llama(43, vocab=16, layers=2, head_scale=2.0), tiny_llama(44, vocab=16, head_scale=2.0)
    for name in ("ot_m1", "onehot_eagle"):
        cfg, s = CFGS[name]
        cfg = cfg.with_(support=16)
        kernel = _run(target, draft, cfg, s, 7, passes=None, n=20)
        ref = _run(target, draft, cfg, s, 7, passes=DEFAULT_PIPELINE, n=20)
        assert kernel.tokens == ref.tokens, name
