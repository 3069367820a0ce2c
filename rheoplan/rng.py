"""Counter-based random streams: every draw is a pure function of
``(seed, step, tree, node, purpose)``, so a decode is reproducible from one seed,
any draw can be recomputed (or injected) in isolation, and drafting and verification
never share numbers (they differ in ``purpose``).
"""

from __future__ import annotations

from enum import IntEnum

import numpy as np
import torch

from rheoplan.mutation import active


class Purpose(IntEnum):
    """Why numbers are drawn; part of the counter, so streams never overlap."""

    DRAFT_SAMPLE = 1  #: Gumbel noise for the sampled slot's token (assign pass)
    VERIFY_ACCEPT = 2  #: the accept/reject uniform of a coupling
    VERIFY_RESIDUAL = 3  #: Gumbel noise for a residual or plain target draw


def philox_counter(step, tree, node, purpose):
    """The 4-word Philox counter of one draw: ``[0, step, tree, node * 8 + purpose]``.

    Word 0 stays 0 because numpy advances it once per block of 4 numbers: keeping our
    ids out of it is what makes long draws of neighbouring steps disjoint (an earlier
    layout with ``step`` in word 0 made numbers 5-8 of step s equal numbers 1-4 of step
    s+1). Works elementwise on numpy arrays too (the numba Philox in
    ``rheoplan.kernels.philox`` builds its counters with this function).

    Example: ``philox_counter(3, 0, 5, 2)`` -> ``[0, 3, 0, 42]``.
    """
    return [0 * step, step, tree, node * 8 + purpose]


class Streams:
    """Independent counter-based streams from one seed (numpy Philox).

    Example:
        >>> s = Streams(7)
        >>> bool((s.uniform(0, 0, 3, Purpose.VERIFY_ACCEPT, 2) == s.uniform(0, 0, 3, Purpose.VERIFY_ACCEPT, 2)).all())
        True
    """

    def __init__(self, seed: int):
        if isinstance(seed, bool) or not isinstance(seed, int) or not (0 <= seed < 2**63):
            raise ValueError(f"seed={seed!r} is out of range: allowed an int in [0, 2**63)")
        self.seed = seed

    def purpose_key(self, purpose: Purpose) -> int:
        """The purpose actually used in the counter (the test-only mutation
        ``"reuse_draft_stream"`` of ``rheoplan.mutation`` collapses them)."""
        if purpose != Purpose.DRAFT_SAMPLE and active("reuse_draft_stream"):
            return int(Purpose.DRAFT_SAMPLE)
        return int(purpose)

    def _gen(self, step: int, tree: int, node: int, purpose: Purpose) -> np.random.Generator:
        ctr = philox_counter(step, tree, node, self.purpose_key(purpose))
        return np.random.Generator(np.random.Philox(key=self.seed, counter=ctr))

    def uniform(self, step: int, tree: int, node: int, purpose: Purpose, n: int) -> torch.Tensor:
        """``n`` uniforms in (0, 1), float64."""
        u = self._gen(step, tree, node, purpose).random(n)
        return torch.from_numpy(np.clip(u, np.finfo(np.float64).tiny, 1.0 - 2**-53))

    def gumbel(self, step: int, tree: int, node: int, purpose: Purpose, n: int) -> torch.Tensor:
        """``n`` standard Gumbel variables, float64: ``-log(-log(u))``."""
        return -torch.log(-torch.log(self.uniform(step, tree, node, purpose, n)))
