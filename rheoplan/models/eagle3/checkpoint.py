"""EAGLE-3 checkpoint I/O: ``config.json`` + ``model.safetensors`` (or ``pytorch_model.bin``),
read strictly.

Two layouts are read:

* the reference layout (that of the EAGLE authors' released EAGLE-3 checkpoints): a flat config (``vocab_size``,
  ``draft_vocab_size``, ``hidden_size``, ...; RoPE in transformers-4 or -5 style) and the
  keys ``fc.weight``, ``midlayer.*``, ``norm.weight``, ``lm_head.weight``, ``d2t``, ``t2d``.
  ``d2t``/``t2d`` may be present with equal vocabularies (the reference code saves them
  always), ``embed_tokens.weight`` (a copy of the target's embeddings; used) and ``fc.bias``
  too;
* the speculators layout (``speculators_model_type: "eagle3"``): the layer's config nested
  in ``transformer_layer_config``, keys ``layers.0.*`` for ``midlayer.*``, and optionally
  ``eagle_aux_hidden_state_layer_ids``. Variants the head does not implement (more than one
  layer, ``norm_before_residual``, ``norm_before_fc``) raise ``Eagle3LoadError`` naming them.

The reference loader is non-strict: a checkpoint with missing keys runs with random weights.
``read_eagle3`` names every missing and unexpected key and every shape mismatch instead.
"""

from __future__ import annotations

import json
import os

import torch

from rheoplan.models.eagle3.head import Eagle3Config, Eagle3Head, Eagle3LoadError, check_vocab_map

CONFIG_NAME = "config.json"
SAFETENSORS_NAME = "model.safetensors"
TORCH_NAME = "pytorch_model.bin"


def save_eagle3(head: Eagle3Head, path: str | os.PathLike) -> None:
    """Write ``config.json`` and ``model.safetensors`` in the reference format."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, CONFIG_NAME), "w") as f:
        json.dump(head.config.to_dict(), f, indent=2, sort_keys=True)
    state = {k: v.detach().contiguous().cpu() for k, v in head.state_dict().items()}
    save_file(state, os.path.join(path, SAFETENSORS_NAME))


def _read_state(path: str) -> dict[str, torch.Tensor]:
    st, pt = os.path.join(path, SAFETENSORS_NAME), os.path.join(path, TORCH_NAME)
    if os.path.exists(st):
        from safetensors.torch import load_file

        return load_file(st)
    if os.path.exists(pt):
        return torch.load(pt, map_location="cpu", weights_only=True)
    raise Eagle3LoadError(f"{path} holds neither {SAFETENSORS_NAME} nor {TORCH_NAME}")


#: speculators' name for the one decoder layer -> the reference name
_SPECULATORS_KEYS = {"layers.0.": "midlayer."}


def _from_speculators(d: dict) -> dict:
    """A speculators EAGLE-3 config as the reference's flat dict (errors for what differs)."""
    kind = d.get("speculators_model_type", "eagle3")
    if kind != "eagle3":
        raise Eagle3LoadError(f"config speculators_model_type={kind!r}: allowed 'eagle3'")
    tl = d.get("transformer_layer_config")
    if not isinstance(tl, dict):
        raise Eagle3LoadError("speculators config lacks transformer_layer_config (the draft layer's "
                              "config): allowed a dict")
    unsupported = []
    if tl.get("num_hidden_layers", 1) != 1:
        unsupported.append(f"transformer_layer_config.num_hidden_layers={tl['num_hidden_layers']} "
                           "(the head has one decoder layer)")
    for flag in ("norm_before_residual", "norm_before_fc"):
        if d.get(flag):
            unsupported.append(f"{flag}=true")
    if tl.get("attention_bias") or tl.get("mlp_bias"):
        unsupported.append("attention_bias/mlp_bias=true (the layer has no biases)")
    if unsupported:
        raise Eagle3LoadError(f"speculators EAGLE-3 config sets {'; '.join(unsupported)}: not supported "
                              "by rheoplan's EAGLE-3 head")
    keep = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
            "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters", "hidden_act",
            "max_position_embeddings", "head_dim")
    flat = {k: tl[k] for k in keep if tl.get(k) is not None}
    for k in ("draft_vocab_size", "target_hidden_size", "eagle_aux_hidden_state_layer_ids"):
        if d.get(k) is not None:
            flat[k] = d[k]
    return flat


def is_speculators_config(d: dict) -> bool:
    return "speculators_model_type" in d or "transformer_layer_config" in d


def read_config(path: str | os.PathLike) -> Eagle3Config:
    """The head's config from ``path/config.json`` (either layout)."""
    cfg_file = os.path.join(os.fspath(path), CONFIG_NAME)
    if not os.path.exists(cfg_file):
        raise Eagle3LoadError(f"{os.fspath(path)} has no {CONFIG_NAME}")
    with open(cfg_file) as f:
        d = json.load(f)
    return Eagle3Config.from_dict(_from_speculators(d) if is_speculators_config(d) else d)


def _reference_keys(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in state.items():
        for old, new in _SPECULATORS_KEYS.items():
            if k.startswith(old):
                k = new + k[len(old):]
        out[k] = v
    return out


def read_eagle3(path: str | os.PathLike, *, dtype: torch.dtype = torch.float32,
                device: str | torch.device = "cpu") -> Eagle3Head:
    """The head stored in ``path`` (config.json + weights), keys and shapes checked strictly.

    Raises ``Eagle3LoadError`` naming every missing and unexpected key and every shape
    mismatch, and any break of the vocabulary-map rule (``check_vocab_map``).
    """
    path = os.fspath(path)
    cfg = read_config(path)
    state = _reference_keys(_read_state(path))
    if "d2t" in state and "t2d" not in state:
        # t2d is redundant (the set of d2t's targets); some writers leave it out
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        ids = torch.arange(state["d2t"].numel()) + state["d2t"].to(torch.int64)
        t2d[ids[(ids >= 0) & (ids < cfg.vocab_size)]] = True
        state["t2d"] = t2d
    head = Eagle3Head(cfg, vocab_map="d2t" in state or cfg.draft_vocab_size != cfg.vocab_size,
                      fc_bias="fc.bias" in state, embed_tokens="embed_tokens.weight" in state)
    expected = head.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    shapes = [f"{k}: checkpoint {tuple(state[k].shape)} vs expected {tuple(v.shape)}"
              for k, v in expected.items() if k in state and state[k].shape != v.shape]
    if missing or unexpected or shapes:
        raise Eagle3LoadError(
            f"EAGLE-3 checkpoint {path} does not match the head built from its config "
            f"(draft_vocab_size={cfg.draft_vocab_size}, vocab_size={cfg.vocab_size}): "
            f"missing keys {missing}; unexpected keys {unexpected}; shape mismatches {shapes}")
    head.load_state_dict(state, strict=True)
    if head.d2t is not None:
        check_vocab_map(head.target_ids(), head.t2d, cfg.vocab_size)
    # Module.to(dtype) casts floating tensors only, so d2t/t2d stay int64/bool.
    return head.to(device=device, dtype=dtype).eval()
