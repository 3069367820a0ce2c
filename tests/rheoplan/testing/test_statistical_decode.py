"""Statistical end-to-end test of the real sampling path (docs/method.md §7.3-7.5):
planner with the Gumbel draft sampler + verify.walk with counter-based streams, over many
independent runs, against the exact law by Pearson chi-square.

False-alarm rate: each goodness-of-fit test rejects when p < ALPHA = 1e-3, so a correct
implementation fails one given test with probability 1e-3 over the choice of seed. The
seeds are fixed, so the suite is deterministic (the fixed seeds pass; a change in any
random-number mapping re-draws them, at that same 1e-3 false-alarm rate per test).
Mutation (c) is detected at p < 1e-12.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rheoplan import SamplingConfig, TreeConfig
from rheoplan.models.functional import hashed_context_lm
from rheoplan.testing import (mutation, chi_square, exact_law, functional_decode, functional_decode_batch,
                              target_law, total_variation)
from rheoplan.testing import strategies as rst

ALPHA = 1e-3
RUNS = 2000
#: Fixed seed of the goodness-of-fit runs. (An earlier choice, 12345, gave p = 8e-4 on
#: "ot_v4_2tok", a false alarm at the stated rate: seeds 1, 2, 3 gave p = 0.90, 0.44, 0.71
#: and 16000 runs gave p = 0.98, TV 0.006 to the exact law.)
SEED = 1

CASES = {
    # name: (V, target seed, draft seed, sharpness, n_tokens, tree, sampling)
    "ot_v4_2tok": (4, 3, 4, 2.0, 2, TreeConfig(depth=2, frontier=1, slots=2, budget=3, rheostat=1, support=4,
                                               verifier="ot"), SamplingConfig(temperature=1.0)),
    "rheo_v3_3tok_topp": (3, 5, 6, 0.8, 3, TreeConfig(depth=2, frontier=1, slots=2, budget=3, rheostat=0, support=3,
                                                      verifier="rheo"), SamplingConfig(temperature=1.0, top_p=0.95)),
}


def _case(name):
    V, ts, ds, sh, n, cfg, s = CASES[name]
    return hashed_context_lm(V, seed=ts, sharpness=sh), hashed_context_lm(V, seed=ds, sharpness=sh), n, cfg, s


@pytest.mark.no_ir_lint
@pytest.mark.parametrize("name", sorted(CASES))
def test_real_decode_matches_exact_law(name):
    tgt, drf, n, cfg, s = _case(name)
    law = exact_law(tgt, drf, (0, 1), n, tree=cfg, sampling=s)
    assert total_variation(law, target_law(tgt, (0, 1), n, s)) <= 1e-9
    samples = functional_decode_batch(tgt, drf, (0, 1), n, RUNS, tree=cfg, sampling=s, seed=SEED)
    res = chi_square(law, samples)
    assert res.unexpected == 0
    assert res.pvalue >= ALPHA, res


@pytest.mark.no_ir_lint
def test_mutation_c_reused_draft_stream_is_detected():
    """Verification drawing from the draft stream: the accept uniform at a node is the
    uniform that gave tail index 0 its Gumbel noise when Y was drawn, so acceptance is
    correlated with which Y was drawn. The same test as above rejects it."""
    tgt, drf, n, cfg, s = _case("ot_v4_2tok")
    law = exact_law(tgt, drf, (0, 1), n, tree=cfg, sampling=s)
    with mutation("reuse_draft_stream"):
        samples = functional_decode_batch(tgt, drf, (0, 1), n, RUNS, tree=cfg, sampling=s, seed=SEED)
    res = chi_square(law, samples)
    assert res.pvalue < 1e-12, res


@pytest.mark.no_ir_lint
def test_single_decode_is_run_zero_of_batch():
    tgt, drf, n, cfg, s = _case("ot_v4_2tok")
    for seed in (0, 7):
        batch = functional_decode_batch(tgt, drf, (0, 1), 6, 3, tree=cfg, sampling=s, seed=seed)
        assert tuple(functional_decode(tgt, drf, (0, 1), 6, tree=cfg, sampling=s, seed=seed)) == batch[0]
        assert functional_decode_batch(tgt, drf, (0, 1), 6, 3, tree=cfg, sampling=s, seed=seed) == batch


def _greedy(lm, prefix, n, sampling):
    ctx, out = tuple(prefix), []
    from rheoplan.distributions import target_probs

    for _ in range(n):
        x = int(torch.argmax(target_probs(lm([ctx])[0], sampling)))
        out.append(x)
        ctx += (x,)
    return out


@pytest.mark.no_ir_lint
@settings(max_examples=15, deadline=None)
@given(st.data())
def test_greedy_parity(data):
    """At T = 0 the emitted tokens equal plain greedy decoding of the target."""
    V = data.draw(rst.vocab_sizes())
    tgt, drf = data.draw(rst.lm_specs(V)).build(), data.draw(rst.lm_specs(V)).build()
    s = SamplingConfig(temperature=0.0)
    cfg = data.draw(rst.tree_configs(V, s, max_leaves=None))
    prefix = data.draw(st.lists(st.integers(0, V - 1), min_size=1, max_size=3))
    seed = data.draw(st.integers(0, 2**31 - 1))
    got = functional_decode(tgt, drf, prefix, 8, tree=cfg, sampling=s, seed=seed)
    assert got == _greedy(tgt, prefix, 8, s)
