"""EAGLE-3 checkpoints as they exist in the wild, written to tmp dirs (safetensors):
vocabulary maps with equal vocabularies, a saved ``embed_tokens.weight``, ``fc.bias``,
transformers-4 and -5 RoPE configs and scaling types, the speculators layout; and every
mismatch with the target found when the draft is paired with it, before any model work."""

from __future__ import annotations

import json
import re

import pytest
import torch

from _adapter_models import tiny_llama
from rheoplan import SamplingConfig, TreeConfig
from rheoplan.decode import plan_and_decode
from rheoplan.models.eagle3 import (Eagle3Config, Eagle3Draft, Eagle3Head, Eagle3LoadError,
                                    load_eagle3_checkpoint, read_eagle3)

V, H = 101, 64
ATOL = 1e-5


def random_head(cfg: Eagle3Config, seed: int = 0, **kw) -> Eagle3Head:
    torch.manual_seed(seed)
    head = Eagle3Head(cfg, **kw)
    with torch.no_grad():
        for name, p in head.named_parameters():
            p.normal_(0, 0.2)
    return head.eval()


def base_cfg(**kw) -> Eagle3Config:
    args = dict(vocab_size=V, hidden_size=H, intermediate_size=128, num_attention_heads=4,
                num_key_value_heads=2)
    args.update(kw)
    return Eagle3Config(**args)


def write(path, config: dict, state: dict) -> None:
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in state.items()}, str(path / "model.safetensors"))


def head_out(head: Eagle3Head, embed: torch.Tensor, seed: int = 1) -> torch.Tensor:
    """Target-vocabulary logits after a 3-pair chain with fixed features (positions 5..7)."""
    g = torch.Generator().manual_seed(seed)
    feats = torch.randn(3, 3 * head.config.target_hidden_size, generator=g)
    toks = torch.tensor([3, 7, 11])
    allowed = torch.ones(3, 3, dtype=torch.bool).tril()
    with torch.no_grad():
        h, _ = head(embed[toks], feats, torch.arange(5, 8), None, allowed)
        return head.target_logits(h)


@pytest.fixture(scope="module")
def target6():
    return tiny_llama(seed=1, layers=6)


# --------------------------------------------------------------------------------------
# Keys the reference code writes
# --------------------------------------------------------------------------------------

def test_equal_vocabularies_with_d2t_t2d_load_and_are_validated(tmp_path):
    head = random_head(base_cfg())
    state = dict(head.state_dict(), d2t=torch.zeros(V, dtype=torch.int64), t2d=torch.ones(V, dtype=torch.bool))
    write(tmp_path / "ok", head.config.to_dict(), state)
    back = read_eagle3(tmp_path / "ok")
    assert back.d2t is not None and torch.equal(back.target_ids(), torch.arange(V))
    embed = torch.randn(V, H)
    torch.testing.assert_close(head_out(back, embed), head_out(head, embed), atol=0, rtol=0)
    # a d2t that maps two draft ids to one target id, and a t2d that disagrees, are named
    bad = dict(state, d2t=torch.zeros(V, dtype=torch.int64))
    bad["d2t"][5] = 1  # draft 5 -> target 6, like draft 6
    write(tmp_path / "dup", head.config.to_dict(), bad)
    with pytest.raises(Eagle3LoadError, match=r"same target ids \[6\]"):
        read_eagle3(tmp_path / "dup")
    flags = dict(state, t2d=torch.ones(V, dtype=torch.bool))
    flags["t2d"][[4, 9]] = False
    write(tmp_path / "t2d", head.config.to_dict(), flags)
    with pytest.raises(Eagle3LoadError, match=r"d2t maps to target ids \[4, 9\] that t2d does not flag"):
        read_eagle3(tmp_path / "t2d")


def test_missing_t2d_is_derived_from_d2t(tmp_path):
    cfg = base_cfg(draft_vocab_size=40)
    head = random_head(cfg)
    head.set_vocab_map(torch.randperm(V)[:40].sort().values)
    state = {k: v for k, v in head.state_dict().items() if k != "t2d"}
    write(tmp_path, cfg.to_dict(), state)
    assert torch.equal(read_eagle3(tmp_path).t2d, head.t2d)


def test_saved_embed_tokens_are_used(tmp_path, target6):
    head = random_head(base_cfg())
    own = torch.randn(V, H)
    write(tmp_path, head.config.to_dict(), dict(head.state_dict(), **{"embed_tokens.weight": own}))
    draft = load_eagle3_checkpoint(tmp_path, target6)
    assert torch.equal(draft.embed, own) and not torch.equal(own, target6.get_input_embeddings().weight)
    torch.testing.assert_close(head_out(draft.head, draft.embed), head_out(head, own), atol=0, rtol=0)
    assert torch.equal(load_eagle3_checkpoint(tmp_path).embed, own)  # no target needed


def test_fc_bias_is_loaded_and_used(tmp_path):
    head = random_head(base_cfg(), fc_bias=True)
    assert "fc.bias" in head.state_dict()
    write(tmp_path, head.config.to_dict(), head.state_dict())
    back = read_eagle3(tmp_path)
    assert torch.equal(back.fc.bias, head.fc.bias) and float(back.fc.bias.detach().abs().sum()) > 0
    x = torch.randn(2, 3 * H)
    torch.testing.assert_close(back.fuse(x), x @ head.fc.weight.T + head.fc.bias)


# --------------------------------------------------------------------------------------
# RoPE: transformers-4 and -5 styles, scaling types
# --------------------------------------------------------------------------------------

def _inv_freq(head):
    return head.rotary.inv_freq.clone()


def test_rope_theta_in_rope_parameters_is_read(tmp_path):
    """transformers-5 style: before, theta 5e5 in rope_parameters was silently read as 1e4."""
    head = random_head(base_cfg(rope_theta=5e5))
    cfg = head.config.to_dict()
    del cfg["rope_theta"], cfg["rope_scaling"]
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 5e5}
    write(tmp_path / "v5", cfg, head.state_dict())
    back = read_eagle3(tmp_path / "v5")
    assert back.config.rope_theta == 5e5 and back.config.rope_scaling is None
    assert torch.equal(_inv_freq(back), _inv_freq(head))
    embed = torch.randn(V, H)
    torch.testing.assert_close(head_out(back, embed), head_out(head, embed), atol=0, rtol=0)
    slow = random_head(base_cfg(rope_theta=1e4))
    slow.load_state_dict(head.state_dict())
    assert (head_out(slow, embed) - head_out(head, embed)).abs().max() > 1e-3  # theta matters here
    cfg["rope_theta"] = 1e4  # two thetas that disagree: an error, not a pick
    write(tmp_path / "both", cfg, head.state_dict())
    with pytest.raises(Eagle3LoadError, match=r"rope_theta=10000.0 and rope_parameters.rope_theta=500000.0"):
        read_eagle3(tmp_path / "both")


SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 256},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256},
}


@pytest.mark.parametrize("kind", sorted(SCALINGS))
@pytest.mark.parametrize("style", ["v4_rope_scaling", "v4_type_key", "v5_rope_parameters"])
def test_rope_scaling_types_match_transformers(tmp_path, kind, style):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    sc = dict(SCALINGS[kind])
    head = random_head(base_cfg(max_position_embeddings=2048))
    cfg = {k: v for k, v in head.config.to_dict().items() if k not in ("rope_theta", "rope_scaling")}
    if style == "v5_rope_parameters":
        cfg["rope_parameters"] = dict(sc, rope_theta=5e5)
    else:
        if style == "v4_type_key":
            sc["type"] = sc.pop("rope_type")
        cfg.update(rope_theta=5e5, rope_scaling=sc)
    write(tmp_path, cfg, head.state_dict())
    back = read_eagle3(tmp_path)
    ref = LlamaRotaryEmbedding(LlamaConfig(hidden_size=H, num_attention_heads=4, head_dim=16,
                                           max_position_embeddings=2048,
                                           rope_parameters=dict(SCALINGS[kind], rope_theta=5e5)))
    plain = LlamaRotaryEmbedding(LlamaConfig(hidden_size=H, num_attention_heads=4, head_dim=16,
                                             max_position_embeddings=2048,
                                             rope_parameters={"rope_type": "default", "rope_theta": 5e5}))
    x, pos = torch.zeros(1, 4, H), torch.tensor([[0, 100, 1000, 2000]])
    got, want = back.rotary(x, pos), ref(x, pos)
    torch.testing.assert_close(got[0], want[0], atol=0, rtol=0)
    torch.testing.assert_close(got[1], want[1], atol=0, rtol=0)
    assert not torch.allclose(got[0], plain(x, pos)[0])  # the scaling is really applied


@pytest.mark.parametrize("scaling,match", [
    ({"rope_type": "dynamic", "factor": 2.0}, r"type 'dynamic' is not supported: allowed \['default', 'linear', 'llama3', 'yarn'\]"),
    ({"type": "longrope", "short_factor": [1.0]}, r"type 'longrope' is not supported"),
    ({"rope_type": "llama3", "factor": 8.0}, r"'llama3' lacks \['low_freq_factor', 'high_freq_factor', 'original_max_position_embeddings'\]"),
])
def test_unsupported_rope_scaling_is_a_clear_error(tmp_path, scaling, match):
    head = random_head(base_cfg())
    write(tmp_path, dict(head.config.to_dict(), rope_scaling=scaling), head.state_dict())
    with pytest.raises(Eagle3LoadError, match=match):
        read_eagle3(tmp_path)


# --------------------------------------------------------------------------------------
# The speculators layout
# --------------------------------------------------------------------------------------

def speculators_files(head: Eagle3Head, embed: torch.Tensor, **top):
    c = head.config
    config = {
        "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
        "speculators_version": "0.2.0", "draft_vocab_size": c.draft_vocab_size, "norm_before_residual": False,
        "target_hidden_size": None,
        "transformer_layer_config": {
            "model_type": "llama", "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
            "intermediate_size": c.intermediate_size, "num_attention_heads": c.num_attention_heads,
            "num_key_value_heads": c.num_key_value_heads, "num_hidden_layers": 1, "rms_norm_eps": c.rms_norm_eps,
            "rope_theta": 5e5, "max_position_embeddings": 2048, "hidden_act": "silu", "head_dim": c.head_dim,
        },
        "speculators_config": {"algorithm": "eagle3", "verifier": {"name_or_path": "some/target"}},
    }
    config.update(top)
    state = {("layers.0." + k[len("midlayer."):] if k.startswith("midlayer.") else k): v
             for k, v in head.state_dict().items()}
    state["embed_tokens.weight"] = embed
    return config, state


def test_speculators_layout_loads_and_matches_the_reference_layout(tmp_path):
    cfg = base_cfg(draft_vocab_size=50, rope_theta=5e5, max_position_embeddings=2048)
    head = random_head(cfg)
    head.set_vocab_map(torch.randperm(V)[:50].sort().values)
    embed = torch.randn(V, H)
    config, state = speculators_files(head, embed, eagle_aux_hidden_state_layer_ids=[1, 3, 4])
    write(tmp_path, config, state)
    back = read_eagle3(tmp_path)
    assert back.config.eagle_aux_hidden_state_layer_ids == [1, 3, 4] and back.config.rope_theta == 5e5
    torch.testing.assert_close(head_out(back, back.embed_tokens.weight), head_out(head, embed), atol=0, rtol=0)
    assert Eagle3Draft(back).capture_layers(6) == [1, 3, 4]


@pytest.mark.parametrize("change,match", [
    (lambda c: c["transformer_layer_config"].update(num_hidden_layers=2), r"num_hidden_layers=2 \(the head has one"),
    (lambda c: c.update(norm_before_residual=True), r"norm_before_residual=true"),
    (lambda c: c.update(speculators_model_type="eagle"), r"speculators_model_type='eagle': allowed 'eagle3'"),
])
def test_speculators_variants_the_head_does_not_implement_are_named(tmp_path, change, match):
    head = random_head(base_cfg())
    config, state = speculators_files(head, torch.randn(V, H))
    change(config)
    write(tmp_path, config, state)
    with pytest.raises(Eagle3LoadError, match=match):
        read_eagle3(tmp_path)


# --------------------------------------------------------------------------------------
# Pairing with the target: every mismatch found before any model work
# --------------------------------------------------------------------------------------

def _count_forwards(model):
    calls = []
    handle = model.register_forward_pre_hook(lambda *a, **k: calls.append(1))
    return calls, handle


MISMATCHES = {
    # name: (head config changes, target layers, message parts)
    "target_hidden_size": (dict(target_hidden_size=48), 6,
                           [r"target_hidden_size=48 \(its fc reads 3 \* 48 = 144", r"target's hidden_size is 64"]),
    "layer_count": (dict(), 3, [r"target has 3 decoder layers", r">= 4"]),
    "aux_layers": (dict(eagle_aux_hidden_state_layer_ids=[1, 3, 7]), 6,
                   [r"layers \[1, 3, 7\]", r"has 6 layers \(layers \[7\] do not exist\)"]),
    "vocabulary": (dict(vocab_size=120), 6, [r"vocab_size=120", r"target has 101 tokens"]),
}


@pytest.mark.parametrize("name", sorted(MISMATCHES))
def test_mismatch_with_the_target_is_found_at_pairing(tmp_path, name):
    changes, layers, parts = MISMATCHES[name]
    cfg = base_cfg(**changes)
    head = random_head(cfg)
    embed = torch.randn(cfg.vocab_size, H)
    write(tmp_path, cfg.to_dict(), dict(head.state_dict(), **{"embed_tokens.weight": embed}))
    target = tiny_llama(seed=2, layers=layers)
    calls, handle = _count_forwards(target)
    try:
        with pytest.raises(Eagle3LoadError) as err:  # load_eagle3_checkpoint pairs with the model
            load_eagle3_checkpoint(tmp_path, target)
        for part in parts:
            assert re.search(part, str(err.value)), (part, str(err.value))
        draft = load_eagle3_checkpoint(tmp_path)  # unpaired: loads
        with pytest.raises(ValueError) as err2:  # plan_and_decode pairs it again, before any forward
            plan_and_decode(target, draft, [1, 2, 3], max_new_tokens=3, seed=0,
                            tree=TreeConfig(depth=2, frontier=1, slots=2, budget=2, support=8))
        assert name in ("vocabulary",) or str(err2.value) == str(err.value)
        assert calls == []
    finally:
        handle.remove()


def test_d2t_t2d_disagreement_lists_the_ids_at_pairing(target6):
    cfg = base_cfg(draft_vocab_size=30)
    head = random_head(cfg)
    head.set_vocab_map(torch.arange(30) * 3)
    with torch.no_grad():
        head.t2d[[3, 6]] = False
        head.t2d[[1, 2]] = True
    draft = Eagle3Draft(head, target6.get_input_embeddings(), features_from=target6)
    with pytest.raises(Eagle3LoadError, match=r"t2d flags target ids \[1, 2\] that d2t does not map to, and "
                                              r"d2t maps to target ids \[3, 6\] that t2d does not flag"):
        draft.check_target(target6)


def test_an_adapter_that_captures_other_layers_is_named(target6):
    from rheoplan.models.hf_target import HFTarget

    head = random_head(base_cfg(eagle_aux_hidden_state_layer_ids=[1, 2, 4]))
    draft = Eagle3Draft(head, target6.get_input_embeddings(), features_from=target6)
    default = HFTarget(target6, capture_layers="eagle3")
    try:
        with pytest.raises(Eagle3LoadError, match=r"captures layers \[2, 3, 3\] .* reads the inputs of layers "
                                                  r"\[1, 2, 4\]: build it with HFTarget\(model, capture_layers=\[1, 2, 4\]\)"):
            draft.check_target(default)
    finally:
        default.close()
    right = HFTarget(target6, capture_layers=[1, 2, 4])
    try:
        draft.check_target(right)
        r = plan_and_decode(right, draft, [1, 2, 3, 4], max_new_tokens=6, seed=0,
                            sampling=SamplingConfig(temperature=0),
                            tree=TreeConfig(depth=2, frontier=2, slots=2, budget=3, support=V))
        assert len(r.tokens) == 6
    finally:
        right.close()
