"""``RowCache`` (rheoplan.models.row_cache) against transformers' own cache and a plain
forward: a left-padded batch prefill, a batched step with holes, compaction and rows
leaving give each row the hidden states it has alone."""

from __future__ import annotations

import pytest
import torch

from _adapter_models import tiny_llama
from rheoplan.models._hf_common import base_model
from rheoplan.models.row_cache import RowCache
from rheoplan.testing import mutation

PROMPTS = [[1, 2, 3, 4, 5], [7], [9, 8, 7]]


@pytest.fixture(scope="module")
def model():
    return tiny_llama(0, vocab=32, hidden=32, layers=2)


def _alone(model, ids: list[int]) -> torch.Tensor:
    """Final hidden states of a plain causal forward of ``ids`` (no cache of ours)."""
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]


def _prefill(model, prompts) -> tuple[RowCache, torch.Tensor]:
    B, n = len(prompts), max(len(p) for p in prompts)
    rc = RowCache(model, B, torch.device("cpu"))
    tok = torch.zeros(B, n, dtype=torch.int64)
    pos = torch.zeros(B, n, dtype=torch.int64)
    real = torch.zeros(B, n, dtype=torch.bool)
    for b, p in enumerate(prompts):
        tok[b, n - len(p):] = torch.tensor(p)
        pos[b, n - len(p):] = torch.arange(len(p))
        real[b, n - len(p):] = True
    block = (torch.ones(n, n, dtype=torch.bool).tril()[None] & real[:, None, :]) | \
        (torch.eye(n, dtype=torch.bool)[None] & ~real[:, :, None])
    with torch.no_grad():
        h = rc.forward(base_model(model), tok, pos, block)
    rc.keep([list(range(n - len(p), n)) for p in prompts])
    return rc, h


def test_prefill_equals_transformers_left_padded_batch_and_plain_forwards(model):
    rc, h = _prefill(model, PROMPTS)
    n = h.shape[1]
    # transformers' own batch: DynamicCache, left padding, a 2-D attention mask
    ids = torch.zeros(len(PROMPTS), n, dtype=torch.int64)
    mask = torch.zeros(len(PROMPTS), n, dtype=torch.int64)
    for b, p in enumerate(PROMPTS):
        ids[b, n - len(p):] = torch.tensor(p)
        mask[b, n - len(p):] = 1
    with torch.no_grad():
        # positions as ``generate`` makes them for left padding
        out = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0),
                    output_hidden_states=True, use_cache=True)
    ref = out.hidden_states[-1]
    cache = out.past_key_values if getattr(out, "cache", None) is None else out.cache
    for b, p in enumerate(PROMPTS):
        k = len(p)
        torch.testing.assert_close(h[b, n - k:], ref[b, n - k:], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(h[b, n - k:], _alone(model, p), atol=1e-5, rtol=1e-5)
        # the cached keys of the real tokens equal transformers' own cache
        torch.testing.assert_close(rc.cache.layers[0].keys[b, :, n - k:], cache.layers[0].keys[b, :, n - k:])
    assert rc.lengths() == [len(p) for p in PROMPTS]


def _step(model, rc: RowCache, nxt: list[list[int]], starts: list[int]) -> torch.Tensor:
    """Append a causal chain ``nxt[b]`` per row (padded), positions from ``starts``."""
    B, q = len(nxt), max(len(x) for x in nxt)
    tok = torch.zeros(B, q, dtype=torch.int64)
    pos = torch.zeros(B, q, dtype=torch.int64)
    block = torch.zeros(B, q, q, dtype=torch.bool)
    for b, x in enumerate(nxt):
        tok[b, :len(x)] = torch.tensor(x)
        pos[b, :len(x)] = torch.arange(starts[b], starts[b] + len(x))
        block[b, :len(x), :len(x)] = torch.ones(len(x), len(x), dtype=torch.bool).tril()
        for i in range(len(x), q):
            block[b, i, i] = True
    with torch.no_grad():
        return rc.forward(base_model(model), tok, pos, block)


@pytest.mark.parametrize("compact", [False, True])
def test_holes_compaction_and_leaving_rows_keep_each_rows_law(model, compact):
    rc, _ = _prefill(model, PROMPTS)
    seqs = [list(p) for p in PROMPTS]
    # step 1: each row forwards 3 candidates but keeps a different number (holes)
    cand = [[4, 6, 8], [3, 2, 1], [5, 5, 5]]
    keep_n = [1, 3, 0]
    S0 = rc.width
    _step(model, rc, cand, [len(s) for s in seqs])
    rc.keep([[S0 + j for j in range(k)] for k in keep_n])
    for b, k in enumerate(keep_n):
        seqs[b] += cand[b][:k]
    if compact:
        rc.compact()
        assert rc.width == max(len(s) for s in seqs)
    # row 1 leaves; the others go on
    rc.select([0, 2])
    seqs = [seqs[0], seqs[2]]
    h = _step(model, rc, [[11, 12], [13]], [len(s) for s in seqs])
    for b, (s, x) in enumerate(zip(seqs, [[11, 12], [13]])):
        torch.testing.assert_close(h[b, :len(x)], _alone(model, s + x)[len(s):], atol=1e-5, rtol=1e-5)
    # the mutation control: a row reading its neighbour's entries is caught by this check
    with mutation("batch_shift_rows"):
        h2 = _step(model, rc, [[11, 12], [13]], [len(s) for s in seqs])
    assert not torch.allclose(h2[0, :2], _alone(model, seqs[0] + [11, 12])[len(seqs[0]):], atol=1e-3)


def test_commit_paths_moves_accepted_entries_and_leaves_one_row_without_holes(model):
    """``commit_paths``: each row's accepted tree columns move to the front of the tree's
    part (a branching path: not the first columns), the rest are dropped; a later step of
    each row equals a plain forward of its committed tokens. One row keeps no holes."""
    rc, _ = _prefill(model, PROMPTS)
    seqs = [list(p) for p in PROMPTS]
    S0 = rc.width
    # every row forwards a chain of 4 candidates; rows accept columns [0, 2] / [0, 1, 2, 3] / [0]
    # (column 2 after 0 is a legal path in a tree where 1 and 2 are siblings: here the chain
    # mask makes 2 see 1, so row 0 checks the move with a block that matches it)
    cand = [[4, 6, 8, 10], [3, 2, 1, 5], [5, 5, 5, 5]]
    B, q = 3, 4
    tok = torch.tensor(cand)
    pos = torch.stack([torch.arange(len(s), len(s) + q) for s in seqs])
    block = torch.ones(q, q, dtype=torch.bool).tril()[None].repeat(B, 1, 1)
    block[0] = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    pos[0] = torch.tensor([len(seqs[0]), len(seqs[0]) + 1, len(seqs[0]) + 1, len(seqs[0]) + 2])
    with torch.no_grad():
        rc.forward(base_model(model), tok, pos, block)
    paths = [[0, 2], [0, 1, 2, 3], [0]]
    rc.commit_paths(S0, paths)
    for b, p in enumerate(paths):
        seqs[b] += [cand[b][j] for j in p]
    assert rc.width == S0 + 4 and rc.lengths() == [len(s) for s in seqs]
    h = _step(model, rc, [[11, 12], [13], [14]], [len(s) for s in seqs])
    for b, (s, x) in enumerate(zip(seqs, [[11, 12], [13], [14]])):
        torch.testing.assert_close(h[b, :len(x)], _alone(model, s + x)[len(s):], atol=1e-5, rtol=1e-5)

    one, _ = _prefill(model, [PROMPTS[0]])
    S0 = one.width
    with torch.no_grad():
        one.forward(base_model(model), tok[:1], pos[:1], block[:1])
    one.commit_paths(S0, [[0, 2, 3]])
    assert one.width == S0 + 3 and bool(one.valid.all())
    with pytest.raises(ValueError, match="outside"):
        one.forward(base_model(model), tok[:1, :2], pos[:1, :2] + 3, block[:1, :2, :2])
        one.commit_paths(S0 + 3, [[0, 5]])
