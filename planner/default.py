"""The default pipeline: reading it top to bottom explains the whole planner.

    expand@1, assign@1, expand@2, assign@2, ..., expand@D, assign@D, prune, linearize

Any pass can be removed, replaced or wrapped: it is only a list. It is the one list
``plan_tree``, ``plan_and_decode`` and the exact oracle run; each built-in pass names its
numba and Triton implementations next to itself, and ``rheoplan.pipeline.lower(passes,
backend)`` swaps them in (a pass of your own stays as written).
"""

from __future__ import annotations

from rheoplan.pipeline import Repeat
from rheoplan.planner.assign import assign_pass
from rheoplan.planner.expand import expand_pass
from rheoplan.planner.linearize import linearize_pass
from rheoplan.planner.prune import prune_pass

DEFAULT_PIPELINE = [
    Repeat("grow", (
        expand_pass,  # pick the frontier, draft it, create K slots each
        assign_pass,  # draw the sampled tokens, fill PAD slots
    ), times=lambda ctx: ctx.tree_cfg.depth),
    prune_pass,  # keep the best `budget` nodes
    linearize_pass,  # order, positions, masks, verifier tables
]
