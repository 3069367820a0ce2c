"""GrowingLayer: appends in place, and gives what transformers' DynamicLayer gives through
every rewrite rheoplan does to a cache (narrow, in-place moves, replacement, reset)."""

from __future__ import annotations

import random

import torch
from transformers.cache_utils import DynamicLayer

from rheoplan.models._hf_common import commit_cache, crop_cache, new_cache, select_cache
from rheoplan.models.growing_cache import GrowingLayer, append, capacity, growing_layers


def _kv(rng: random.Random, batch: int, q: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    return torch.randn(batch, 2, q, 4, generator=g), torch.randn(batch, 2, q, 4, generator=g)


class _Holder:
    """A one-layer cache shaped as ``_hf_common`` reads one (``.layers``, ``get_seq_length``)."""

    def __init__(self, layer) -> None:
        self.layers = [layer]

    def get_seq_length(self) -> int:
        return self.layers[0].get_seq_length()


def test_growing_layer_equals_dynamic_layer_through_every_rewrite():
    rng = random.Random(0)
    grow, plain = _Holder(GrowingLayer()), _Holder(DynamicLayer())
    for step in range(60):
        k, v = _kv(rng, 3, rng.randint(1, 9))
        a = grow.layers[0].update(k, v)
        b = plain.layers[0].update(k, v)
        for x, y in zip(a, b):
            assert torch.equal(x, y)
        n = grow.get_seq_length()
        op = rng.choice(["none", "none", "crop", "commit", "select"])
        if op == "crop":
            keep = rng.randint(0, n)
            crop_cache(grow, keep), crop_cache(plain, keep)
        elif op == "commit":
            q = k.shape[2]
            path = sorted(rng.sample(range(q), rng.randint(1, q)))
            commit_cache(grow, n - q, path), commit_cache(plain, n - q, path)
        elif op == "select":
            keep = torch.tensor(sorted(rng.sample(range(n), rng.randint(1, n))))
            select_cache(grow, keep), select_cache(plain, keep)
        assert torch.equal(grow.layers[0].keys, plain.layers[0].keys)
        assert torch.equal(grow.layers[0].values, plain.layers[0].values)
    grow.layers[0].reset()
    plain.layers[0].reset()
    k, v = _kv(rng, 3, 5)
    assert all(torch.equal(x, y) for x, y in zip(grow.layers[0].update(k, v), plain.layers[0].update(k, v)))


def test_a_commit_or_crop_keeps_the_fast_append(monkeypatch):
    """After ``commit_cache`` or ``crop_cache`` narrowed a ``GrowingLayer``, its next
    ``update`` writes into the buffer without ``append`` (the narrowed views are the
    buffer's prefixes); after ``select_cache`` replaced its tensors it goes through
    ``append`` once. The values equal ``DynamicLayer``'s all along."""
    import rheoplan.models.growing_cache as gc

    calls = []
    real = gc.append
    monkeypatch.setattr(gc, "append", lambda *a: calls.append(1) or real(*a))
    rng = random.Random(1)
    grow, plain = _Holder(GrowingLayer()), _Holder(DynamicLayer())

    def step(q: int) -> int:
        calls.clear()
        k, v = _kv(rng, 2, q)
        for x, y in zip(grow.layers[0].update(k, v), plain.layers[0].update(k, v)):
            assert torch.equal(x, y)
        return len(calls)

    assert step(5) == 2  # the first update makes the buffers
    commit_cache(grow, 0, [0, 2, 3]), commit_cache(plain, 0, [0, 2, 3])
    assert step(4) == 0
    crop_cache(grow, 5), crop_cache(plain, 5)
    assert step(1) == 0
    keep = torch.tensor([0, 2, 4, 5])
    select_cache(grow, keep), select_cache(plain, keep)
    crop_cache(grow, 3), crop_cache(plain, 3)  # a replaced tensor narrowed: still not the buffer's
    assert step(2) == 2
    assert step(1) == 0


def test_free_column_is_where_the_fast_append_would_write():
    """``free_column`` / ``written`` (a caller writing the new columns itself, as the lean
    forward's fused rotary kernel does) give what ``update`` gives, and ``free_column``
    refuses where ``update`` must append: no buffer yet, another row count, no room, a
    tensor replaced from outside."""
    rng = random.Random(2)
    grow, plain = _Holder(GrowingLayer()), _Holder(DynamicLayer())
    layer = grow.layers[0]
    assert layer.free_column(2, 1) is None  # nothing cached yet
    k, v = _kv(rng, 2, 3)
    layer.update(k, v), plain.layers[0].update(k, v)
    room = layer.buffers[0].shape[2]
    assert layer.free_column(2, 1) == 3 and layer.free_column(3, 1) is None
    assert layer.free_column(2, room - 3) == 3 and layer.free_column(2, room - 2) is None
    crop_cache(grow, 2), crop_cache(plain, 2)
    assert layer.free_column(2, 4) == 2
    k, v = _kv(rng, 2, 4)
    key_buf, value_buf = layer.buffers
    key_buf[:, :, 2:6], value_buf[:, :, 2:6] = k, v
    got, want = layer.written(2, 4), plain.layers[0].update(k, v)
    assert all(torch.equal(x, y) for x, y in zip(got, want))
    assert got[0] is layer.keys and layer.free_column(2, 1) == 6  # the fast path goes on
    select_cache(grow, torch.tensor([0, 2, 5])), select_cache(plain, torch.tensor([0, 2, 5]))
    assert layer.free_column(2, 1) is None  # replaced: the next update appends once
    k, v = _kv(rng, 2, 1)
    assert all(torch.equal(x, y) for x, y in zip(layer.update(k, v), plain.layers[0].update(k, v)))
    assert layer.free_column(2, 1) == 4


def test_growing_layers_are_named_only_where_an_append_may_bypass_the_caches_update(llama):
    """``growing_layers``: a rheoplan cache's layers; None for a cache whose ``update`` is
    not transformers' own (it may do more than the layer's), one that offloads, or one
    with fewer layers than asked; transformers' own ``DynamicLayer``s are not named."""
    from transformers import DynamicCache

    cache = new_cache(llama)
    n = len(cache.layers)
    assert [type(x) for x in growing_layers(cache, n)] == [GrowingLayer] * n
    assert growing_layers(cache, n + 1) is None
    assert growing_layers(DynamicCache(config=llama.config), n) == [None] * n

    class Spy(DynamicCache):
        def update(self, *a, **kw):
            return super().update(*a, **kw)

    assert growing_layers(Spy(config=llama.config), n) is None
    cache.offloading = True
    assert growing_layers(cache, n) is None


def test_append_writes_into_spare_columns_and_grows_only_when_full():
    buf = None
    cur = torch.empty(0)
    ptrs = set()
    for _ in range(100):
        cur, buf = append(cur, buf, torch.ones(2, 3, 1, 4))
        ptrs.add(buf.data_ptr())
    assert cur.shape == (2, 3, 100, 4) and buf.shape[2] >= 100
    # 1 column + 64 spare, then at the 66th column one buffer with 64 spare again
    assert len(ptrs) == 2 and buf.shape[2] == capacity(66) == 66 + 64
    # a replaced tensor (not the buffer's prefix) is copied into a new buffer once
    other = cur.clone()
    cur2, buf2 = append(other, buf, torch.zeros(2, 3, 1, 4))
    assert buf2.data_ptr() != buf.data_ptr() and torch.equal(cur2[:, :, :100], other)


def test_new_cache_grows_in_place_and_a_model_forward_is_unchanged(llama):
    cache = new_cache(llama)
    assert all(type(layer) is GrowingLayer for layer in cache.layers)
    ids = torch.tensor([[3, 9, 14, 2, 7, 1]])
    ref = llama(ids).logits[0, -1]
    with torch.no_grad():
        llama.model(input_ids=ids[:, :4], cache=cache, use_cache=True)
        ptr = cache.layers[0].keys.data_ptr()
        llama.model(input_ids=ids[:, 4:5], cache=cache, use_cache=True)
        out = llama(input_ids=ids[:, 5:], cache=cache, use_cache=True).logits[0, -1]
    assert cache.layers[0].keys.data_ptr() == ptr  # appended in place
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


def test_a_layer_initialised_from_outside_appends():
    """``RowCache.extend`` gives an empty layer its tensors directly (no ``update``): the
    next append still works and equals ``torch.cat``."""
    layer = GrowingLayer()
    k = torch.randn(2, 3, 5, 4)
    layer.keys, layer.values, layer.is_initialized = k, k + 1, True
    new = torch.randn(2, 3, 1, 4)
    keys, values = layer.update(new, new)
    assert torch.equal(keys, torch.cat([k, new], dim=2)) and torch.equal(values, torch.cat([k + 1, new], dim=2))
    keys, _ = layer.update(new, new)  # the fast path from here on
    assert torch.equal(keys, torch.cat([k, new, new], dim=2))
