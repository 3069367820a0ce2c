"""Verification kernels (docs/method.md §5): the couplings 'onehot', 'rheo' and 'ot'
with injected randomness (one accept uniform and Gumbel noise over the vocabulary per
node), and a full-walk variant that verifies whole trees given the target law at every
linear node (what the GPU runs after one verify forward).

Ground truth: ``rheoplan.verify.coupling_sample``. ``reference`` (torch), ``cpu``
(numba) and ``triton`` share signatures.
"""

from rheoplan.config import VERIFIER_CODES  # noqa: F401  (re-exported for the kernels)
