"""Counter-based random streams: every draw is a pure function of
``(seed, step, tree, node, purpose)``, so a decode is reproducible from one seed,
any draw can be recomputed (or injected) in isolation, and drafting and verification
never share numbers (they differ in ``purpose``).
"""

from __future__ import annotations

from enum import IntEnum

import numpy as np
import torch


class Purpose(IntEnum):
    """Why numbers are drawn; part of the counter, so streams never overlap."""

    DRAFT_SAMPLE = 1  #: Gumbel noise for the sampled slot's token (assign pass)
    VERIFY_ACCEPT = 2  #: the accept/reject uniform of a coupling
    VERIFY_RESIDUAL = 3  #: Gumbel noise for a residual or plain target draw


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
        #: test-only switch for mutation control (c): verification reuses the draft stream
        self.reuse_draft_stream = False

    def _gen(self, step: int, tree: int, node: int, purpose: Purpose) -> np.random.Generator:
        if self.reuse_draft_stream and purpose != Purpose.DRAFT_SAMPLE:
            purpose = Purpose.DRAFT_SAMPLE
        return np.random.Generator(np.random.Philox(key=self.seed, counter=[step, tree, node, int(purpose)]))

    def uniform(self, step: int, tree: int, node: int, purpose: Purpose, n: int) -> torch.Tensor:
        """``n`` uniforms in (0, 1), float64."""
        u = self._gen(step, tree, node, purpose).random(n)
        return torch.from_numpy(np.clip(u, np.finfo(np.float64).tiny, 1.0 - 2**-53))

    def gumbel(self, step: int, tree: int, node: int, purpose: Purpose, n: int) -> torch.Tensor:
        """``n`` standard Gumbel variables, float64: ``-log(-log(u))``."""
        return -torch.log(-torch.log(self.uniform(step, tree, node, purpose, n)))
