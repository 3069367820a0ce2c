"""Power (docs/method.md §7.4): each deliberately lossy variant is DETECTED.

(a) sampled node scored by its true q + verifier skipping pruned sampled children, and
(b) raw q(Y) instead of q~(Y) in the ratio and residual, by the exact oracle (TV far
above 1e-9); (c) one uniform reused for drafting and verifying, by the statistical test
(in test_statistical_decode.py, which runs the real sampler: the oracle branches over
laws, not random numbers, so it cannot see (c))."""

from __future__ import annotations

import pytest

from rheoplan import SamplingConfig, TreeConfig
from rheoplan.models.functional import hashed_context_lm
from rheoplan.testing import exact_law, mutation, target_law, total_variation

S = SamplingConfig(temperature=1.0)
PREFIX = (0, 1)


def _tv(V, seed, cfg, mutations):
    tgt, drf = hashed_context_lm(V, seed=seed, sharpness=1.5), hashed_context_lm(V, seed=seed + 50, sharpness=1.5)
    with mutation(*mutations):
        law = exact_law(tgt, drf, PREFIX, 2, tree=cfg, sampling=S)
    return total_variation(law, target_law(tgt, PREFIX, 2, S))


CASE_A = [  # (verifier, (depth, frontier, slots, budget), measured TV)
    ("rheo", (2, 2, 3, 3), 0.2425),
    ("ot", (2, 2, 2, 3), 0.1565),
]


@pytest.mark.parametrize("verifier,shape,expected", CASE_A)
def test_mutation_a_skip_pruned_sampled_with_true_q_is_detected(verifier, shape, expected):
    D, k, K, N = shape
    cfg = TreeConfig(depth=D, frontier=k, slots=K, budget=N, rheostat=1, support=5, verifier=verifier, proxy="true_q")
    tv = _tv(5, 0, cfg, {"skip_pruned_sampled"})
    assert tv > 0.05, tv  # detected: the threshold is 1e-9
    assert tv == pytest.approx(expected, abs=1e-3)
    # control of the control: the real verifier (phantom rule) is exact on the same case
    assert _tv(5, 0, cfg, ()) <= 1e-9


@pytest.mark.parametrize("proxy", ["default", "next_rank"])
def test_skip_pruned_sampled_is_exact_with_identity_independent_proxy(proxy):
    """Skipping pruned sampled children only breaks losslessness when the shape depends
    on Y (true_q): with a Y-independent proxy, whether Y's node is kept is independent of Y."""
    cfg = TreeConfig(depth=2, frontier=2, slots=3, budget=3, rheostat=1, support=5, verifier="rheo", proxy=proxy)
    assert _tv(5, 0, cfg, {"skip_pruned_sampled"}) <= 1e-9


@pytest.mark.parametrize("verifier,expected", [("rheo", 0.1473), ("ot", 0.1218)])
def test_mutation_b_raw_q_ratio_is_detected(verifier, expected):
    cfg = TreeConfig(depth=2, frontier=2, slots=3, budget=4, rheostat=1, support=4, verifier=verifier)
    tv = _tv(4, 0, cfg, {"raw_q_ratio"})
    assert tv > 0.05, tv  # detected: the threshold is 1e-9
    assert tv == pytest.approx(expected, abs=1e-3)
    assert _tv(4, 0, cfg, ()) <= 1e-9
