"""Hypothesis-driven end-to-end decodes through ``plan_and_decode`` with random tree and
sampling configs, on tiny FunctionalLM models and a tiny HF Llama pair.

Every example checks: no crash; the output-length / EOS rules; step bookkeeping; for the
HF pair, that the compacted KV cache equals a fresh forward. On tiny vocabularies the
output law is checked too: the exact oracle (``exact_law`` == ``target_law`` to 1e-9) and
the real loop's samples against it by chi-square at ALPHA = 1e-3 per example.

``derandomize=True``: the examples are a fixed function of the test, so the suite is
deterministic (the statistical check has its stated false-alarm rate per example over
that fixed draw, like the fixed seeds of test_decode.py).
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from _decode_models import check_cache_matches_fresh_forward, tiny_llama
from rheoplan.decode import plan_and_decode
from rheoplan.models.hf_target import HFTarget
from rheoplan.testing import chi_square, exact_law, target_law, total_variation
from rheoplan.testing import strategies as rst

ALPHA = 1e-3
FUZZ = settings(max_examples=12, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


# Tiny forwards on a shared 2-core machine: one intra-op thread is ~5x faster than many.
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def check_output_rules(r, max_new_tokens: int, eos: set[int]) -> None:
    """Length, EOS and per-step bookkeeping of one ``DecodeResult``."""
    toks = r.tokens
    assert 1 <= len(toks) <= max_new_tokens
    first_eos = next((j for j, t in enumerate(toks) if t in eos), None)
    if r.stopped_by == "eos":
        assert first_eos == len(toks) - 1, (toks, eos)  # stops at the first EOS, includes it
    else:
        assert r.stopped_by == "max_new_tokens"
        assert first_eos is None and len(toks) == max_new_tokens
    assert sum(s.emitted for s in r.steps) == len(toks)
    for s in r.steps[:-1]:
        assert s.emitted == s.accepted + 1  # only the last step may be cut
    last = r.steps[-1]
    assert 1 <= last.emitted <= last.accepted + 1
    for s in r.steps:
        assert 0 <= s.accepted <= s.tree_size and s.visited == s.accepted + 1
        assert s.trials <= s.accepted + 1


@st.composite
def functional_cases(draw):
    case = draw(rst.oracle_cases(max_depth=2, max_leaves=24, n_tokens=(1, 2)))
    V = case.target.vocab
    eos = draw(st.one_of(st.none(), st.integers(0, V - 1)))
    max_new = draw(st.integers(1, 6))
    return case, eos, max_new


@pytest.mark.no_ir_lint
@FUZZ
@given(functional_cases())
def test_fuzz_functional_rules(args):
    case, eos, max_new = args
    tgt, drf = case.target.build(), case.draft.build()
    eos_set = set() if eos is None else {eos}
    for seed in range(3):
        r = plan_and_decode(tgt, drf, list(case.prefix), max_new_tokens=max_new, sampling=case.sampling,
                            tree=case.tree, seed=seed, eos_token_id=eos)
        check_output_rules(r, max_new, eos_set)


@pytest.mark.no_ir_lint
@settings(FUZZ, max_examples=6)
@given(rst.oracle_cases(vocab=3, max_depth=2, max_leaves=16, n_tokens=(2,)))
def test_fuzz_functional_law_matches_oracle(case):
    tgt, drf = case.target.build(), case.draft.build()
    law = target_law(tgt, case.prefix, case.n_tokens, case.sampling)
    assert total_variation(exact_law(tgt, drf, case.prefix, case.n_tokens, tree=case.tree,
                                     sampling=case.sampling), law) <= 1e-9
    samples = [tuple(plan_and_decode(tgt, drf, list(case.prefix), max_new_tokens=case.n_tokens,
                                     sampling=case.sampling, tree=case.tree, seed=5000 + r).tokens)
               for r in range(250)]
    res = chi_square(law, samples)
    assert res.unexpected == 0, (res, case)
    assert res.pvalue >= ALPHA, (res, case)


# --------------------------------------------------------------------------------------
# Tiny HF Llama pair
# --------------------------------------------------------------------------------------

HF_V = 6
_MODELS = {}


def _hf_pair():
    if not _MODELS:
        _MODELS["t"] = tiny_llama(21, vocab=HF_V, layers=2, head_scale=3.0)
        _MODELS["d"] = tiny_llama(22, vocab=HF_V, layers=1, head_scale=3.0)
    return _MODELS["t"], _MODELS["d"]


@st.composite
def hf_cases(draw):
    s = draw(rst.sampling_configs(HF_V, temperatures=(1.0, 0.0, 0.6, 1.7)))
    cfg = draw(rst.tree_configs(HF_V, s, max_depth=4, max_frontier=3, max_leaves=None))
    prompt = draw(st.lists(st.integers(0, HF_V - 1), min_size=1, max_size=5))
    eos = draw(st.one_of(st.none(), st.integers(0, HF_V - 1)))
    max_new = draw(st.integers(1, 10))
    use_draft = draw(st.sampled_from([True, True, True, False]))
    return s, cfg, prompt, eos, max_new, use_draft


@pytest.mark.no_ir_lint
@settings(FUZZ, max_examples=8)
@given(hf_cases(), st.integers(0, 2**32))
def test_fuzz_hf_pair_rules_and_cache(case, seed):
    s, cfg, prompt, eos, max_new, use_draft = case
    model, draft = _hf_pair()
    adapter = HFTarget(model)
    r = plan_and_decode(adapter, draft if use_draft else None, prompt, max_new_tokens=max_new, sampling=s,
                        tree=cfg, seed=seed, eos_token_id=eos)
    check_output_rules(r, max_new, set() if eos is None else {eos})
    check_cache_matches_fresh_forward(adapter, model, prompt + r.tokens)
