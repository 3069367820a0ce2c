"""Cache surgery helpers: an O(tree) commit equals keeping the same entries by index."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, LlamaConfig

from rheoplan.models._hf_common import cache_length, commit_cache, crop_cache, select_cache


def _cache(seq: int, seed: int = 0) -> DynamicCache:
    cfg = LlamaConfig(hidden_size=8, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=2,
                      intermediate_size=16, vocab_size=10)
    cache = DynamicCache(config=cfg)
    g = torch.Generator().manual_seed(seed)
    for layer in range(2):
        k = torch.randn(1, 1, seq, 4, generator=g)
        cache.update(k, k + 100, layer)
    return cache


def _tensors(cache):
    return [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]


@pytest.mark.parametrize("prefix,path", [(5, [0]), (5, [0, 1, 2]), (3, [0, 2, 5]), (0, [0, 3]), (4, [0, 1, 4, 6])])
def test_commit_cache_equals_select_cache(prefix, path):
    a, b = _cache(prefix + 7), _cache(prefix + 7)
    commit_cache(a, prefix, path)
    select_cache(b, torch.tensor(list(range(prefix)) + [prefix + p for p in path]))
    assert cache_length(a) == prefix + len(path)
    for (ka, va), (kb, vb) in zip(_tensors(a), _tensors(b)):
        assert torch.equal(ka, kb) and torch.equal(va, vb)


def test_crop_cache_keeps_the_first_entries():
    a = _cache(9)
    before = _tensors(a)
    crop_cache(a, 4)
    assert cache_length(a) == 4
    for (k, v), (k0, v0) in zip(_tensors(a), before):
        assert torch.equal(k, k0[..., :4, :]) and torch.equal(v, v0[..., :4, :])
