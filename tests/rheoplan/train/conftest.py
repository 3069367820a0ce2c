"""Tiny random Llama target shared by the training tests (no SmolLM2 loading)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def tiny_target():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=64, max_position_embeddings=256,
                      tie_word_embeddings=True)
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def tiny_rows(tiny_target):
    """Sampled rows (prompt + continuation) with features and top-8 targets."""
    from rheoplan.train.selfdistill import sample_with_features

    g = torch.Generator().manual_seed(0)
    prompts = [[1, 5, 6, 7, 8 + i % 5, 9 + i] for i in range(12)] + [[1, 5, 6, 20 + i] for i in range(12)]
    rows = []
    for b in range(0, len(prompts), 8):
        rows += sample_with_features(tiny_target, prompts[b:b + 8], max_new_tokens=12, temperature=1.0,
                                     eos_id=0, topk=8, generator=g)
    return rows
