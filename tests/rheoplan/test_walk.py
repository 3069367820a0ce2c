"""``rheoplan.walk``: the likely path the lazy projection prefetches (the walk's route
itself is tested with the backends, ``test_backends.py``, and the verifiers)."""

from __future__ import annotations

import pytest

from _planner_helpers import path_hash_draft
from rheoplan import SamplingConfig, TreeConfig, plan_tree
from rheoplan.walk import likely_path


def _likely_path_by_hand(tree, b):
    """From the root, the kept child with the highest score, the lower linear index first
    among equal scores, down to a leaf; read entry by entry from the tensors."""
    lin, out, i = tree.linear, [0], 0
    while int(lin.n_children[b, i]) > 0:
        kids = [c for c in range(int(lin.n[b])) if int(lin.parent[b, c]) == i]
        best = kids[0]
        for c in kids[1:]:
            if float(tree.score[b, int(lin.node[b, c])]) > float(tree.score[b, int(lin.node[b, best])]):
                best = c
        out.append(best)
        i = best
    return out


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("rheostat", [0, 1, 3])
def test_likely_path_follows_the_best_scored_kept_child(seed, rheostat):
    cfg = TreeConfig(depth=4, frontier=3, slots=3, budget=12, rheostat=rheostat, support=8)
    t = plan_tree(path_hash_draft(10, seed), [1, 2, 3], tree=cfg, sampling=SamplingConfig(), seed=seed,
                  prefix_len=[0, 4, 9])
    paths = [likely_path(t, b) for b in range(t.batch)]
    assert paths == [_likely_path_by_hand(t, b) for b in range(t.batch)]
    assert any(len(p) > 2 for p in paths)
