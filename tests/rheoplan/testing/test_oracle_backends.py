"""The exact oracle holds with the lowered pipeline: ``exact_law(..., backend=)`` plans
every tree realisation with the numba or Triton passes (Triton under the interpreter on
CPU), and the law of the whole decode still equals the target's to 1e-9. The mutation
controls are still detected with a lowered pipeline."""

from __future__ import annotations

import pytest

from rheoplan import SamplingConfig, TreeConfig
from rheoplan.models.functional import hashed_context_lm
from rheoplan.testing import exact_law, mutation, target_law, total_variation

TOL = 1e-9
K = 3


@pytest.fixture(scope="module")
def models4():
    return hashed_context_lm(4, seed=21, sharpness=1.5), hashed_context_lm(4, seed=22, sharpness=1.5)


def _cases():
    """(backend, verifier, m, T): numba on the whole grid; Triton (slow under the interpreter,
    ~5-15 s each) on three cases by default, the rest marked slow."""
    grid = [(v, m, T) for v in ("onehot", "rheo", "ot") for m in (0, 1, K - 1) for T in (0.0, 1.0)]
    fast_triton = {("onehot", K - 1, 1.0), ("rheo", 1, 1.0), ("ot", K - 1, 0.0)}
    for v, m, T in grid:
        yield pytest.param("numba", v, m, T)
        marks = [pytest.mark.interpreter] + ([] if (v, m, T) in fast_triton else [pytest.mark.slow])
        yield pytest.param("triton", v, m, T, marks=marks)


@pytest.mark.parametrize("backend,verifier,m,T", list(_cases()))
def test_exact_oracle_with_lowered_pipeline(models4, backend, verifier, m, T):
    tgt, drf = models4
    s = SamplingConfig(temperature=T)
    cfg = TreeConfig(depth=2, frontier=2, slots=K, budget=4, rheostat=m, support=4, verifier=verifier)
    n = 3 if T == 0 else 2
    law = exact_law(tgt, drf, (0, 1), n, tree=cfg, sampling=s, backend=backend)
    assert abs(sum(law.values()) - 1.0) < 1e-12
    assert total_variation(law, target_law(tgt, (0, 1), n, s)) <= TOL


@pytest.mark.parametrize("backend", ["numba", pytest.param("triton", marks=pytest.mark.interpreter)])
def test_mutation_a_detected_with_lowered_pipeline(backend):
    """Control (a) of test_mutation_controls.py, planned by the lowered passes: same TV."""
    V, S = 5, SamplingConfig(temperature=1.0)
    tgt, drf = hashed_context_lm(V, seed=0, sharpness=1.5), hashed_context_lm(V, seed=50, sharpness=1.5)
    cfg = TreeConfig(depth=2, frontier=2, slots=2, budget=3, rheostat=1, support=5, verifier="ot", proxy="true_q")
    with mutation("skip_pruned_sampled"):
        law = exact_law(tgt, drf, (0, 1), 2, tree=cfg, sampling=S, backend=backend)
    tv = total_variation(law, target_law(tgt, (0, 1), 2, S))
    assert tv == pytest.approx(0.1565, abs=1e-3)


def test_bad_backend():
    tgt = hashed_context_lm(4, seed=1)
    with pytest.raises(ValueError, match="backend='gpu' is not one of"):
        exact_law(tgt, tgt, (0,), 1, backend="gpu")
