"""FunctionalLM, hashed_context_lm and the functional Target/Draft adapters."""

from __future__ import annotations

import random

import pytest
import torch

from _adapter_trees import make_draft_tree, make_linear, path_of, random_tree
from rheoplan.models.base import DraftModel, TargetModel
from rheoplan.models.functional import (
    FunctionalDraft, FunctionalLM, FunctionalTarget, hashed_context_lm, linear_path_indices,
)


def test_hashed_lm_is_deterministic_and_context_dependent():
    a, b = hashed_context_lm(7, seed=1), hashed_context_lm(7, seed=1)
    paths = [(1,), (1, 2), (2, 1), (1, 2, 3), (0, 1, 2, 3)]
    out = a(paths)
    assert out.shape == (5, 7) and out.dtype == torch.float32
    assert torch.equal(out, b(list(reversed(paths))).flip(0))
    # Every context differs from every other, including the same suffix with another prefix.
    for i in range(5):
        for j in range(i + 1, 5):
            assert not torch.equal(out[i], out[j])
    assert not torch.equal(out, hashed_context_lm(7, seed=2)(paths))


def test_hashed_lm_styles():
    paths = [tuple(range(k)) + (3,) for k in range(40)]
    assert torch.all(hashed_context_lm(6, style="flat")(paths) == 0)
    peaked = torch.softmax(hashed_context_lm(6, style="near_onehot")(paths), -1)
    assert torch.all(peaked.max(-1).values > 0.99) and torch.all(peaked.min(-1).values > 0)
    ties = hashed_context_lm(6, style="ties", sharpness=1.0)(paths)
    assert any(len(set(r.tolist())) < 6 for r in ties)
    ninf = hashed_context_lm(6, style="neg_inf")(paths)
    assert torch.isinf(ninf).any() and torch.isfinite(ninf).any(-1).all()
    g = hashed_context_lm(6, tie_levels=2, neg_inf_frac=0.5)(paths)
    assert torch.isinf(g).any() and torch.isfinite(g).any(-1).all()
    mixed = hashed_context_lm(6, style="mixed")(paths)
    assert torch.isfinite(mixed).any(-1).all() and (mixed == 0).all(-1).any()


@pytest.mark.parametrize("kwargs, match", [
    (dict(vocab_size=0), "vocab_size"), (dict(vocab_size=3, style="odd"), "style"),
    (dict(vocab_size=3, sharpness=-1.0), "sharpness"), (dict(vocab_size=3, neg_inf_frac=1.0), "neg_inf_frac"),
    (dict(vocab_size=3, tie_levels=-1), "tie_levels"),
])
def test_hashed_lm_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        hashed_context_lm(**kwargs)


def test_functional_lm_checks_shape_and_empty_paths():
    lm = FunctionalLM(lambda p: torch.zeros(len(p), 4), vocab_size=3)
    with pytest.raises(ValueError, match=r"expected a tensor of shape \(1, 3\)"):
        lm([(1,)])
    with pytest.raises(ValueError, match="empty path"):
        hashed_context_lm(3)([()])


def test_linear_path_indices():
    lin = make_linear([5, 1, 2, 3], [-1, 0, 0, 1], prefix_len=0)
    assert linear_path_indices(lin, 3) == [0, 1, 3]
    assert linear_path_indices(lin, 0) == [0]


def test_target_tree_logits_are_lazy_and_match_paths():
    lm = hashed_context_lm(9, seed=4)
    target = FunctionalTarget(lm)
    assert isinstance(target, TargetModel)
    target.start([1, 2, 3])
    toks, par = random_tree(random.Random(0), 10, 9, root=3)
    tl = target.forward_tree(make_linear(toks, par, prefix_len=2, pad=2))
    want = {i: lm([tuple([1, 2] + [toks[j] for j in path_of(par, i)])])[0] for i in (0, 4, 9)}
    before = lm.n_calls
    for i in (0, 4, 9, 4):
        assert torch.equal(tl.logits(i), want[i])
    assert lm.n_calls - before == 3  # only the visited nodes, each once
    assert tl.features(0) is None
    with pytest.raises(IndexError):
        tl.logits(10)


def test_target_commit_and_errors():
    target = FunctionalTarget(hashed_context_lm(9, seed=4))
    target.start([1, 2, 3])
    lin = make_linear([3, 4, 5, 6], [-1, 0, 0, 2], prefix_len=2)
    with pytest.raises(RuntimeError, match="before forward_tree"):
        target.commit([0])
    target.forward_tree(lin)
    with pytest.raises(ValueError, match="not a child"):
        target.commit([0, 3])
    target.commit([0, 2, 3])
    assert target.context == [1, 2, 3, 5, 6]
    with pytest.raises(ValueError, match="position"):
        target.forward_tree(lin)  # stale positions: prefix is 5 now
    with pytest.raises(ValueError, match="outside"):
        target.start([1, 99])


def test_draft_node_logits_and_commit():
    lm = hashed_context_lm(9, seed=5)
    draft = FunctionalDraft(lm)
    assert isinstance(draft, DraftModel)
    draft.start([1, 2, 3])
    toks, par = [3, 4, 5, 6], [-1, 0, 0, 2]
    tree = make_draft_tree(toks, par, prefix_len=2)
    got = draft.node_logits(tree, [0, 3])
    assert torch.equal(got, lm([(1, 2, 3), (1, 2, 3, 5, 6)]))
    with pytest.raises(ValueError, match="differs from the tokens"):
        draft.commit(tree, [0, 2], [4, 7], [None, None])
    with pytest.raises(ValueError, match="expected len"):
        draft.commit(tree, [0, 2], [5], [None])
    draft.commit(tree, [0, 2, 3], [5, 6, 8], [None] * 3)
    assert (draft.context, draft.root) == ([1, 2, 3, 5, 6], 8)
    with pytest.raises(ValueError, match="root token"):
        draft.node_logits(tree, [0])
