"""A tiny random Llama and a character tokenizer, so the benchmark code runs end to end
in milliseconds without SmolLM2 (the numbers are meaningless; the bookkeeping is not)."""

from __future__ import annotations

import torch

VOCAB = 32


def tiny_llama(seed: int = 0, layers: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=layers, num_attention_heads=2,
                      num_key_value_heads=1, vocab_size=VOCAB, max_position_embeddings=512,
                      tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).eval()


class CharTokenizer:
    """No chat template: ``encode_prompt`` falls back to ``tok(prompt)['input_ids']``."""

    chat_template = None
    eos_token_id = 0

    def __call__(self, text: str) -> dict:
        return {"input_ids": [1 + ord(c) % (VOCAB - 1) for c in text[:12]]}
