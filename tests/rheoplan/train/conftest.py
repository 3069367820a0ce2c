"""Tiny random Llama target (and a character-level chat tokenizer) shared by the training
tests: no SmolLM2 loading, every test runs in seconds."""

from __future__ import annotations

import pytest
import torch

CHAT_TEMPLATE = (
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are tiny.<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def make_tokenizer():
    """A character-level tokenizer with SmolLM2's chat markers (EOS = ``<|im_end|>`` = 2)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<|im_start|>", "<|im_end|>"]
    vocab = {t: i for i, t in enumerate(specials + [chr(i) for i in range(32, 127)] + ["\n"])}
    t = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    t.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=t, unk_token="<unk>", eos_token="<|im_end|>",
                                  bos_token="<|im_start|>")
    tok.chat_template = CHAT_TEMPLATE
    return tok


def make_target(vocab_size: int = 100):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=vocab_size, max_position_embeddings=1024,
                      tie_word_embeddings=True, eos_token_id=2, bos_token_id=1)
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def tiny_target():
    return make_target()


@pytest.fixture(scope="module")
def tiny_tokenizer():
    return make_tokenizer()


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory):
    """A local transformers model directory (what ``--target DIR`` reads)."""
    d = tmp_path_factory.mktemp("tiny_target")
    make_target().save_pretrained(d)
    make_tokenizer().save_pretrained(d)
    return str(d)


@pytest.fixture(scope="module")
def tiny_rows(tiny_target):
    """Sampled rows (prompt + continuation) with teacher-forced features and top-8 targets."""
    from rheoplan.train.features import teacher_forced
    from rheoplan.train.tokens import sample_tokens

    g = torch.Generator().manual_seed(0)
    prompts = [[1, 5, 6, 7, 8 + i % 5, 9 + i] for i in range(12)] + [[1, 5, 6, 20 + i] for i in range(12)]
    rows = []
    for b in range(0, len(prompts), 8):
        rows += sample_tokens(tiny_target, prompts[b:b + 8], max_new_tokens=12, temperature=1.0,
                              eos_id=0, generator=g)
    rows = [{**r, "tokens": torch.tensor(r["tokens"])} for r in rows]
    return teacher_forced(tiny_target, rows, topk=8)
