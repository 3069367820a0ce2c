"""Tiny random-initialised Llama models for the adapter tests (no downloads)."""

from __future__ import annotations

import torch


def tiny_llama(seed: int = 0, vocab: int = 101, layers: int = 2, hidden: int = 64):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab,
                      max_position_embeddings=512, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    # Random init gives near-flat logits; a larger lm_head makes argmax/greedy tests meaningful.
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    return model


def full_logits(model, ids: list[int]) -> torch.Tensor:
    """Plain causal forward of the whole sequence, logits ``[len(ids), V]`` (float32)."""
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0].float()
