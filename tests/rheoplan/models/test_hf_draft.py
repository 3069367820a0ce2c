"""HFDraft: tree attention over its own cache, commit of forwarded/pending tokens.

Tolerance as in test_hf_target.py (fp32, different summation order): 1e-4.
"""

from __future__ import annotations

import random

import pytest
import torch

from _adapter_trees import depths_of, make_draft_tree, path_of, random_tree
from _adapter_models import full_logits, tiny_llama
from rheoplan.models.base import DraftModel
from rheoplan.models.hf_draft import HFDraft, fit_vocab

ATOL = 1e-4


@pytest.fixture(scope="module")
def small():
    return tiny_llama(seed=3)


def _run_steps(model, draft, rng, seq, steps, n_nodes, p_forward=0.7):
    """Random steps: forward depth by depth a random subset, check, commit a random path."""
    for _ in range(steps):
        toks, par = random_tree(rng, n_nodes, 101, root=seq[-1])
        tree = make_draft_tree(toks, par, prefix_len=len(seq) - 1)
        dep = depths_of(par)
        got = {0: draft.node_logits(tree, [0])[0]}
        for d in range(1, max(dep) + 1):
            sel = [i for i in range(n_nodes) if dep[i] == d and par[i] in got and rng.random() < p_forward]
            if sel:
                got.update(zip(sel, draft.node_logits(tree, sel)))
        for v, row in got.items():
            ref = full_logits(model, seq[:-1] + [toks[j] for j in path_of(par, v)])[-1]
            torch.testing.assert_close(row, ref, atol=ATOL, rtol=0)
        leaf = rng.randrange(n_nodes)
        p = path_of(par, leaf)[: rng.randrange(1, dep[leaf] + 2)]
        emitted = [toks[j] for j in p[1:]] + [rng.randrange(101)]
        draft.commit(tree, p, emitted, [None] * len(p))
        seq = seq + emitted
    return seq


def test_node_logits_match_chain_forward_over_steps(small):
    draft = HFDraft(small)
    assert isinstance(draft, DraftModel)
    rng = random.Random(1)
    seq = [3, 9, 14, 2, 7]
    draft.start(seq)
    seq = _run_steps(small, draft, rng, seq, steps=8, n_nodes=10)
    # Nothing rejected survives: cache = committed tokens actually forwarded, in order.
    assert draft.committed_len == len(seq) - 1


def test_one_token_prompt_and_unforwarded_accepted_nodes(small):
    draft = HFDraft(small)
    draft.start([17])
    rng = random.Random(4)
    # p_forward=0 leaves every accepted drafted node unforwarded: all go to pending.
    _run_steps(small, draft, rng, [17], steps=4, n_nodes=6, p_forward=0.0)


def test_repeated_request_does_not_reforward(small):
    draft = HFDraft(small)
    draft.start([1, 2, 3])
    tree = make_draft_tree([3, 4, 5], [-1, 0, 0], prefix_len=2)
    a = draft.node_logits(tree, [0])
    draft.node_logits(tree, [1, 2])
    n = draft.cache.get_seq_length()
    b = draft.node_logits(tree, [0, 2, 1])
    assert draft.cache.get_seq_length() == n
    assert torch.equal(a[0], b[0])


def test_errors(small):
    draft = HFDraft(small)
    tree = make_draft_tree([3, 4, 5], [-1, 0, 1], prefix_len=2)
    with pytest.raises(RuntimeError, match="before start"):
        draft.node_logits(tree, [0])
    draft.start([1, 2, 3])
    with pytest.raises(ValueError, match="was not forwarded"):
        draft.node_logits(tree, [1])
    with pytest.raises(ValueError, match="prefix_len"):
        draft.node_logits(make_draft_tree([3, 4], [-1, 0], prefix_len=7), [0])
    with pytest.raises(ValueError, match="root token"):
        draft.node_logits(make_draft_tree([8, 4], [-1, 0], prefix_len=2), [0])
    with pytest.raises(ValueError, match="outside"):
        draft.node_logits(tree, [0, 9])
    draft.node_logits(tree, [0])
    with pytest.raises(ValueError, match="not a created child"):
        draft.commit(tree, [0, 2], [5, 1], [None, None])


def _run_tensor_steps(model, rng, prompt, steps, n_nodes):
    """Steps on the device path (node ids as tensors: the root alone, then every node of a
    depth in one call) beside the host path with the same calls: equal logits, both equal to
    a chain forward, and the same state after each commit."""
    dev, host = HFDraft(model), HFDraft(model)
    dev.start(prompt)
    host.start(prompt)
    seq = list(prompt)
    for _ in range(steps):
        toks, par = random_tree(rng, n_nodes, 101, root=seq[-1])
        tree = make_draft_tree(toks, par, prefix_len=len(seq) - 1)
        dep = depths_of(par)
        for d in range(max(dep) + 1):
            sel = [i for i in range(n_nodes) if dep[i] == d]
            got = dev.node_logits(tree, torch.tensor(sel))
            assert torch.equal(got, host.node_logits(tree, sel))
            for v, row in zip(sel, got):
                ref = full_logits(model, seq[:-1] + [toks[j] for j in path_of(par, v)])[-1]
                torch.testing.assert_close(row, ref, atol=ATOL, rtol=0)
        leaf = rng.randrange(n_nodes)
        p = path_of(par, leaf)[: rng.randrange(1, dep[leaf] + 2)]
        emitted = [toks[j] for j in p[1:]] + [rng.randrange(101)]
        for d in (dev, host):
            d.commit(tree, p, emitted, [None] * len(p))
        assert (dev._prefix, dev._pending, dev.root) == (host._prefix, host._pending, host.root)
        seq = seq + emitted


def test_tensor_nodes_match_host_path_and_chain_forward(small):
    _run_tensor_steps(small, random.Random(7), [3, 9, 14, 2, 7], steps=5, n_nodes=9)
    _run_tensor_steps(small, random.Random(8), [17], steps=3, n_nodes=5)


def test_tensor_nodes_errors(small):
    draft = HFDraft(small)
    tree = make_draft_tree([3, 4, 5], [-1, 0, 0], prefix_len=2)
    with pytest.raises(RuntimeError, match="before start"):
        draft.node_logits(tree, torch.tensor([0]))
    draft.start([1, 2, 3])
    with pytest.raises(ValueError, match="root must be forwarded alone"):
        draft.node_logits(tree, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="1-D integer tensor"):
        draft.node_logits(tree, torch.tensor([0.0]))
    draft.node_logits(tree, torch.tensor([0]))
    with pytest.raises(ValueError, match="same way"):
        draft.node_logits(tree, [1])
    with pytest.raises(ValueError, match="tree holds 3"):
        draft.node_logits(tree, torch.tensor([1, 2, 1]))
    draft.node_logits(tree, torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="must start with the root"):
        draft.commit(tree, [1], [4], [None])
    host = HFDraft(small)
    host.start([1, 2, 3])
    host.node_logits(tree, [0])
    with pytest.raises(ValueError, match="same way"):
        host.node_logits(tree, torch.tensor([1]))


def test_fit_vocab():
    x = torch.tensor([[1.0, 2.0, 3.0]])
    assert fit_vocab(x, 2).tolist() == [[1.0, 2.0]]
    assert fit_vocab(x, 4)[0, 3] == float("-inf")
