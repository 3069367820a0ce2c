"""Write a pass of your own, put it in the pipeline, and prove it lossless (or not).

Two passes, both inserted right after ``prune``:

* ``drop_unlikely``: un-keeps every node whose cumulative draft probability is below a
  threshold (saves verify compute). It only decides where the walk may go, never what
  the verifier draws, so it is lossless -- the oracle agrees.
* ``tame_sampled`` (a tempting mistake): when the sampled token Y is unlikely, replace it
  by the best tail token. Y then no longer follows its proposal law q~, and the
  oracle reports a clear total-variation error.

Run:  python examples/custom_pass.py     (exit status 0 when both verdicts are right)
"""

from __future__ import annotations

import math
import sys

import torch

from rheoplan import SamplingConfig, TreeConfig
from rheoplan.ir import DraftTree
from rheoplan.models.functional import hashed_context_lm
from rheoplan.pipeline import FnPass, PassContext
from rheoplan.planner.default import DEFAULT_PIPELINE
from rheoplan.testing import exact_law, target_law, total_variation


def drop_unlikely(tree: DraftTree, ctx: PassContext, min_prob: float = 0.05) -> DraftTree:
    """Un-keep nodes whose score is below log(min_prob). Scores never increase along a
    path, so the kept set stays closed under ancestors."""
    t = tree.clone()  # passes are pure: edit a copy
    t.kept.logical_and_(t.score >= math.log(min_prob))  # in place on the copy's tensor
    t.kept[:, 0] = True  # the root always stays
    return t


def tame_sampled(tree: DraftTree, ctx: PassContext, min_q: float = 0.2) -> DraftTree:
    """WRONG on purpose: overwrite an unlikely sampled token with the best tail token."""
    t = tree.clone()
    m = t.rheostat
    for b in range(t.batch):
        for row in range(int(t.n_expanded[b])):
            y = int(t.y_token[b, row])
            if y < 0:
                continue
            rank = int((t.sup_token[b, row] == y).nonzero()[0])
            if float(t.sup_q[b, row, rank]) < min_q and rank != m:
                best = int(t.sup_token[b, row, m])
                t.y_token[b, row] = best
                # the best tail token may already be a PAD sibling: swap the two tokens
                kids = (t.parent[b] == int(t.exp_node[b, row])).nonzero().flatten()
                for c in kids:
                    if int(t.token[b, c]) == best:
                        t.token[b, c] = y
                t.token[b, int(t.y_node[b, row])] = best
    return t


def with_pass_after_prune(extra: FnPass) -> list:
    """A copy of DEFAULT_PIPELINE with ``extra`` right after ``prune``."""
    out = []
    for p in DEFAULT_PIPELINE:
        out.append(p)
        if getattr(p, "name", None) == "prune":
            out.append(extra)
    return out


def tv_with(extra: FnPass) -> float:
    """Exact total variation between the decode's first 2 tokens and the target's."""
    V = 5
    target, draft = hashed_context_lm(V, seed=1, sharpness=1.5), hashed_context_lm(V, seed=2, sharpness=1.5)
    tree = TreeConfig(depth=2, frontier=2, slots=3, budget=5, rheostat=1, support=V, verifier="ot")
    sampling = SamplingConfig(temperature=1.0)
    got = exact_law(target, draft, [0, 1], 2, tree=tree, sampling=sampling,
                    passes=with_pass_after_prune(extra))
    return total_variation(got, target_law(target, [0, 1], 2, sampling))


def main() -> int:
    torch.set_num_threads(1)
    good = tv_with(FnPass("drop_unlikely", drop_unlikely))
    bad = tv_with(FnPass("tame_sampled", tame_sampled))
    print(f"drop_unlikely: total variation {good:.2e}  -> {'lossless' if good < 1e-9 else 'LOSSY'}")
    print(f"tame_sampled:  total variation {bad:.2e}  -> {'lossless' if bad < 1e-9 else 'LOSSY'}")
    return 0 if (good < 1e-9 and bad > 1e-3) else 1


if __name__ == "__main__":
    sys.exit(main())
