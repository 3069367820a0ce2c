"""The exact oracle (docs/method.md §7.1-7.2): the whole multi-step decode's law of the
first tokens equals the target's, to 1e-9 in total variation, across verifiers, proxies,
rheostat 0..K, temperatures, top-k/top-p, and random models and trees (hypothesis)."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import HealthCheck, given, settings

from rheoplan import SamplingConfig, TreeConfig, plan_tree
from rheoplan.models.functional import hashed_context_lm
from rheoplan.testing import (ExactOracle, enumerate_trees, exact_law, target_law,
                              total_variation)
from rheoplan.testing import strategies as rst
from rheoplan.testing.oracle import functional_draft_fn

TOL = 1e-9


@pytest.fixture(scope="module")
def models4():
    return hashed_context_lm(4, seed=21, sharpness=1.5), hashed_context_lm(4, seed=22, sharpness=1.5)


@pytest.mark.parametrize("verifier,proxy,m", list(itertools.product(
    ("onehot", "rheo", "ot"), ("default", "next_rank", "true_q"), range(4))))
def test_grid_verifier_proxy_rheostat(models4, verifier, proxy, m):
    tgt, drf = models4
    s = SamplingConfig(temperature=1.0)
    cfg = TreeConfig(depth=2, frontier=2, slots=3, budget=4, rheostat=m, support=4, verifier=verifier, proxy=proxy)
    law = exact_law(tgt, drf, (0, 1), 2, tree=cfg, sampling=s)
    assert abs(sum(law.values()) - 1.0) < 1e-12
    assert total_variation(law, target_law(tgt, (0, 1), 2, s)) <= TOL


@pytest.mark.parametrize("verifier", ["rheo", "ot"])
@pytest.mark.parametrize("temperature", [0.0, 0.5, 1.0, 1.5])
@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (2, 1.0), (0, 0.6), (3, 0.8)])
def test_grid_sampling(models4, verifier, temperature, top_k, top_p):
    tgt, drf = models4
    s = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p)
    cfg = TreeConfig(depth=3, frontier=1, slots=2, budget=4, rheostat=1, support=4, verifier=verifier)
    law = exact_law(tgt, drf, (3,), 3 if temperature == 0 else 2, tree=cfg, sampling=s)
    assert total_variation(law, target_law(tgt, (3,), 3 if temperature == 0 else 2, s)) <= TOL


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rst.oracle_cases(max_leaves=128))
def test_oracle_random_cases(case):
    tv = case.tv()
    assert tv <= TOL, (tv, case)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rst.oracle_cases(vocab=3, max_leaves=32, n_tokens=(3,)))
def test_oracle_three_tokens(case):
    assert case.tv() <= TOL


def test_enumerated_trees_are_the_planner_trees(models4):
    """Each enumerated realisation is exactly what plan_tree builds when its sampler
    returns the same tail indices; the probabilities sum to one."""
    tgt, drf = models4
    s = SamplingConfig()
    cfg = TreeConfig(depth=2, frontier=2, slots=3, budget=4, rheostat=1, support=4)
    ctx = (0, 1)
    total = 0.0
    for w, t in enumerate_trees(drf, ctx, cfg, s):
        total += w
        # replay: the realised Y of every expansion row, in the order assign draws them
        ys = {int(t.exp_node[0, r]): int(t.y_token[0, r]) for r in range(int(t.n_expanded[0]))}

        def replay(b, node, qt, t=t, ys=ys):
            row = int(t.exp_row[0, node])
            tail = t.sup_token[0, row, 1:int(t.sup_n[0, row])].tolist()
            return tail.index(ys[node])

        t2 = plan_tree(functional_draft_fn(drf, ctx), [ctx[-1]], tree=cfg, sampling=s, prefix_len=[1], sampler=replay)
        assert torch.equal(t2.linear.token, t.linear.token) and torch.equal(t2.kept, t.kept)
        assert torch.equal(t2.y_token, t.y_token)
    assert abs(total - 1.0) < 1e-12


def test_oracle_memoises_and_counts(models4):
    tgt, drf = models4
    o = ExactOracle(tgt, drf, TreeConfig(depth=2, frontier=1, slots=2, budget=3, support=4), SamplingConfig())
    law1 = o.law((0,), 2)
    n = o.n_trees
    assert o.law((0,), 2) is law1 and o.n_trees == n
    assert abs(sum(o.step_law((0,)).values()) - 1.0) < 1e-12


def test_target_law_and_tv_basics(models4):
    tgt, _ = models4
    law = target_law(tgt, (0,), 2, SamplingConfig(temperature=0))
    assert list(law.values()) == [1.0]
    assert total_variation({(0,): 1.0}, {(1,): 1.0}) == 1.0
    with pytest.raises(ValueError, match="n_tokens"):
        target_law(tgt, (0,), 0)
    with pytest.raises(ValueError, match="prefix"):
        target_law(tgt, (), 1)
