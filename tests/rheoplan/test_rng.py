"""Counter-based streams (rheoplan/rng.py): reproducible, and disjoint across every
counter field. A regression test for an overlap bug: with ``step`` in Philox counter
word 0 (which numpy advances once per 4 numbers), numbers 5-8 of a draw at step s were
numbers 1-4 of the same draw at step s+1."""

from __future__ import annotations

import itertools

import pytest
import torch

from rheoplan.rng import Purpose, Streams, philox_counter


def test_same_counter_same_numbers():
    s = Streams(11)
    assert torch.equal(s.uniform(2, 1, 7, Purpose.VERIFY_ACCEPT, 9), s.uniform(2, 1, 7, Purpose.VERIFY_ACCEPT, 9))


@pytest.mark.parametrize("field", ["step", "tree", "node", "purpose"])
def test_neighbouring_counters_draw_disjoint_numbers(field):
    s = Streams(0)
    base = dict(step=4, tree=1, node=3, purpose=Purpose.VERIFY_RESIDUAL)
    other = dict(base)
    other[field] = Purpose.VERIFY_ACCEPT if field == "purpose" else base[field] + 1
    a = s.uniform(*base.values(), 64)
    b = s.uniform(*other.values(), 64)
    assert not bool(torch.isin(b, a).any())


def test_counter_words_keep_block_word_free():
    for step, tree, node, purpose in itertools.product([0, 5], [0, 2], [0, 9], list(Purpose)):
        ctr = philox_counter(step, tree, node, int(purpose))
        assert ctr[0] == 0 and ctr[1] == step and ctr[2] == tree and ctr[3] == node * 8 + int(purpose)


def test_seed_is_validated():
    with pytest.raises(ValueError, match="seed"):
        Streams(-1)
    with pytest.raises(ValueError, match="seed"):
        Streams(1.5)
