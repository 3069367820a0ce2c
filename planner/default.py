"""The default pipeline: reading it top to bottom explains the whole planner.

    expand@1, assign@1, expand@2, assign@2, ..., expand@D, assign@D, prune, linearize

Any pass can be removed, replaced or wrapped: it is only a list.
"""

from __future__ import annotations

from rheoplan.pipeline import FnPass, Repeat
from rheoplan.planner.assign import assign
from rheoplan.planner.expand import expand
from rheoplan.planner.linearize import linearize
from rheoplan.planner.prune import prune

DEFAULT_PIPELINE = [
    Repeat("grow", (
        FnPass("expand", expand),  # pick the frontier, draft it, create K slots each
        FnPass("assign", assign),  # draw the sampled tokens, fill PAD slots
    ), times=lambda ctx: ctx.tree_cfg.depth),
    FnPass("prune", prune),  # keep the best `budget` nodes
    FnPass("linearize", linearize),  # order, positions, masks, verifier tables
]
