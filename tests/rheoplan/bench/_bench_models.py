"""A tiny random Llama and a character tokenizer, so the benchmark code runs end to end
in milliseconds without SmolLM2 (the numbers are meaningless; the bookkeeping is not),
and a made-up run record with phase times (``phase_record``)."""

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


def phase_record(**kw) -> dict:
    """A run record as ``rheoplan.bench.decode.run_group`` writes it: 10 steps in 1.5 s,
    0.2 s of them in draft calls, 0.1 planning, 0.9 verifying, 0.1 walking, 0.05 committing;
    ``kw`` overrides fields."""
    rec = {"method": "rheo-m1-ot", "steps": 10, "seconds": 1.5, "mean_accepted_length": 2.0,
           "tokens_per_second": 20 / 1.5,
           "phase_seconds": {"draft": 0.2, "plan": 0.1, "verify_forward": 0.9, "walk": 0.1, "commit": 0.05}}
    rec.update(kw)
    return rec
