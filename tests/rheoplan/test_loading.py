"""Loading helpers: an EAGLE-3 head in the asked dtype, 'auto' by measurement."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import rheoplan.loading as loading
from rheoplan.models.eagle3 import Eagle3Config, Eagle3Head, save_eagle3


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                         num_attention_heads=4, num_key_value_heads=2)).eval()
    ckpt = tmp_path_factory.mktemp("head")
    save_eagle3(Eagle3Head(Eagle3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                        num_key_value_heads=2)), ckpt)
    return model, ckpt


def _dtype(draft):
    return next(draft.head.parameters()).dtype


@pytest.mark.parametrize("asked, picked, want", [
    ("float32", None, torch.float32), ("bfloat16", None, torch.bfloat16),
    ("auto", torch.bfloat16, torch.bfloat16), ("auto", torch.float32, torch.float32),
])
def test_load_head_in_the_asked_or_measured_dtype(tiny, monkeypatch, asked, picked, want):
    model, ckpt = tiny
    seen = []

    def choose(head, head_id):
        seen.append(head_id)
        return picked, {}

    monkeypatch.setattr(loading, "choose_head_dtype", choose)
    draft = loading.load_head(ckpt, model, asked)
    assert _dtype(draft) is want
    assert seen == ([f"eagle3:{ckpt.resolve()}"] if asked == "auto" else [])


def test_load_head_refuses_an_unknown_dtype(tiny):
    with pytest.raises(ValueError, match=r"draft_dtype='fp16' is not one of"):
        loading.load_head(tiny[1], tiny[0], "fp16")
