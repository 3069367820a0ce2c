"""The Triton tree-attention kernel inside a transformers model (``HFTarget.use_tree_attention``).

Tiny random Llama / Qwen2 / Mistral models in float32, a branching tree over a non-empty
prefix cache: the verify forward through the kernel (interpreter on CPU, compiled on a GPU)
equals the dense-mask forward of the model's own attention. Tolerance 1e-4 absolute on
logits of magnitude ~10-100: the online softmax sums in another order than SDPA, through
two layers and a lm_head scaled by 20 (see _adapter_models).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel module is imported

from _adapter_trees import make_linear  # noqa: E402

from rheoplan.models.hf_target import HFTarget  # noqa: E402
from rheoplan.models.tree_attention import TREE_ATTENTION, TreeAttentionArgs, tree_attention_forward  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PROMPT = [5, 9, 2, 7, 3, 11, 4]
#: root, two branches of depth 2 and 3, a second child at depth 1: 8 nodes
PARENTS = [-1, 0, 0, 1, 1, 2, 5, 3]
TOKENS = [4, 17, 23, 8, 30, 12, 40, 6]


def _model(family: str, head_dim: int | None = None, seed: int = 0):
    import transformers as tf

    kw = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=61, max_position_embeddings=256, tie_word_embeddings=False)
    if head_dim is not None:
        kw["head_dim"] = head_dim
    cfg_cls, model_cls = {"llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
                          "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
                          "mistral": (tf.MistralConfig, tf.MistralForCausalLM)}[family]
    if family == "mistral":
        kw["sliding_window"] = None
    torch.manual_seed(seed)
    model = model_cls(cfg_cls(**kw)).eval().to(DEVICE)
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    return model


def _verify_logits(model, tree_attention: bool, pad: int = 0) -> torch.Tensor:
    target = HFTarget(model)
    if tree_attention:
        target.use_tree_attention(True)
    target.start(PROMPT)
    lin = make_linear(TOKENS, PARENTS, prefix_len=len(PROMPT) - 1, pad=pad)
    out = target.forward_tree(lin).all_logits()
    target.close()
    return out.cpu()


@pytest.mark.interpreter
@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_verify_forward_matches_dense_mask(family):
    model = _model(family)
    before = model.config._attn_implementation
    dense = _verify_logits(model, tree_attention=False)
    kernel = _verify_logits(model, tree_attention=True)
    assert model.config._attn_implementation == before  # restored after the verify forward
    torch.testing.assert_close(kernel, dense, rtol=1e-5, atol=1e-4)


@pytest.mark.interpreter
@pytest.mark.parametrize("head_dim", [80, 96])
def test_head_dims_padded(head_dim):
    model = _model("llama", head_dim=head_dim, seed=1)
    torch.testing.assert_close(_verify_logits(model, True), _verify_logits(model, False), rtol=1e-5, atol=1e-4)


@pytest.mark.interpreter
def test_padded_linear_tree_and_decode_step():
    """A LinearTree with padded slots (only the first n nodes are forwarded), then commit and a
    second verify on the compacted cache: both equal the dense path."""
    model = _model("llama", seed=2)
    outs = []
    for use in (False, True):
        target = HFTarget(model)
        target.use_tree_attention(use)
        target.start(PROMPT)
        lin = make_linear(TOKENS, PARENTS, prefix_len=len(PROMPT) - 1, pad=3)
        first = target.forward_tree(lin).all_logits()
        target.commit([0, 2, 5])
        lin2 = make_linear([6, 1, 2], [-1, 0, 0], prefix_len=target.cached_len)
        outs.append((first, target.forward_tree(lin2).all_logits()))
        target.close()
    for a, b in zip(*outs):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-4)


@pytest.mark.interpreter
def test_kernel_is_really_used(monkeypatch):
    """Mutation control: a broken kernel output must change the logits (the switch is live)."""
    from rheoplan.kernels.tree_attention import triton as tk

    model = _model("llama", seed=3)
    dense = _verify_logits(model, False)
    real = tk.tree_attention
    monkeypatch.setattr(tk, "tree_attention", lambda *a, **k: real(*a, **k) * 0.5)
    assert not torch.allclose(_verify_logits(model, True), dense, atol=1e-2)


def test_prefill_keeps_the_model_attention():
    """start() (prefill) never calls the registered function; without the keyword it refuses."""
    model = _model("llama", seed=4)
    target = HFTarget(model)
    if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs the interpreter on CPU")
    assert target.use_tree_attention(True) is True
    target.start(PROMPT)  # would raise inside the model if prefill went through the kernel
    assert model.config._attn_implementation != TREE_ATTENTION
    q = torch.zeros(1, 2, 3, 16)
    with pytest.raises(RuntimeError, match="rheoplan_tree"):
        tree_attention_forward(model.model.layers[0].self_attn, q, q, q, None)
    args = TreeAttentionArgs(torch.zeros(1, dtype=torch.int64), torch.zeros(1, 3, 1, dtype=torch.int64))
    with pytest.raises(NotImplementedError, match="sliding"):
        tree_attention_forward(None, q, q, q, None, rheoplan_tree=args, sliding_window=4)
    target.close()


def test_unavailable_device_is_refused(monkeypatch):
    model = _model("llama", seed=5)
    target = HFTarget(model)
    if DEVICE == "cpu":
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
            target.use_tree_attention(True)
        assert not target.tree_attention
    target.close()


def test_functional_target_has_no_attention_to_switch():
    from rheoplan.models import as_target, hashed_context_lm

    assert as_target(hashed_context_lm(8, seed=0)).use_tree_attention(True) is False
