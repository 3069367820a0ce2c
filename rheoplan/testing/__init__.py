"""Testing tools users can run against rheoplan (or against a verifier of their own).

* ``exact_law(target, draft, prefix, n_tokens, tree=, sampling=)``: the exact law of the
  first ``n_tokens`` tokens of the whole multi-step decode, by enumeration of every
  draft draw and verifier outcome (docs/method.md §7.1).
* ``target_law(target, prefix, n_tokens, sampling)``: what that law must equal.
* ``total_variation(a, b)``: compare two laws (``{tokens: probability}``).
* ``coupling_marginal_error(coupling, p, ...)``: one node; ``exact_law(..., coupling=)``
  runs the whole-decode oracle with a verifier of your own.
* ``functional_decode`` / ``functional_decode_batch``: the real sampling path (planner +
  ``rheoplan.verify.walk`` with counter-based streams) over functional models, for
  statistical tests; ``chi_square`` compares its samples with an exact law.
* ``mutation(*names)``: a context manager that turns on the test-only lossy switches
  of ``rheoplan.mutation`` (the mutation controls every losslessness test must fail on).
* ``rheoplan.testing.device``: ``count_host_syncs()`` and ``count_triton_launches()``, what
  one decode step costs the host on the Triton backend.
* ``rheoplan.testing.strategies`` (needs ``hypothesis``): tiny vocabularies, awkward
  logits, hashed-context models, tree / sampling configs, whole oracle cases.

Models are functional (``rheoplan.models.functional.FunctionalLM``): pure functions of
the full token path, so context matters at every depth of a draft tree.

Example:
    >>> from rheoplan import TreeConfig, SamplingConfig
    >>> from rheoplan.models.functional import hashed_context_lm
    >>> from rheoplan.testing import exact_law, target_law, total_variation
    >>> tgt, drf = hashed_context_lm(4, seed=1), hashed_context_lm(4, seed=2)
    >>> cfg = TreeConfig(depth=2, frontier=2, slots=2, budget=3, rheostat=1, support=4, verifier="rheo")
    >>> s = SamplingConfig(temperature=0.5)
    >>> total_variation(exact_law(tgt, drf, [0], 2, tree=cfg, sampling=s), target_law(tgt, [0], 2, s)) < 1e-9
    True
"""

from rheoplan.mutation import MUTATIONS, mutation
from rheoplan.testing.functional_decode import functional_decode, functional_decode_batch
from rheoplan.testing.oracle import (ExactOracle, coupling_marginal_error, enumerate_trees, exact_law,
                                     target_law, total_variation, verify_law)
from rheoplan.testing.stats import chi_square, empirical_law

__all__ = ["exact_law", "target_law", "total_variation", "ExactOracle", "enumerate_trees", "verify_law", "coupling_marginal_error",
           "functional_decode", "functional_decode_batch", "chi_square", "empirical_law",
           "mutation", "MUTATIONS"]


def __getattr__(name):  # lazy: strategies needs hypothesis, an optional test dependency
    if name == "strategies":
        import importlib

        return importlib.import_module("rheoplan.testing.strategies")
    raise AttributeError(f"module 'rheoplan.testing' has no attribute {name!r}")
