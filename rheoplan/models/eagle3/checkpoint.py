"""EAGLE-3 checkpoint I/O: ``config.json`` + ``model.safetensors`` (or ``pytorch_model.bin``)
in the layout of the EAGLE authors' released EAGLE-3 checkpoints, read strictly.

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


def read_config(path: str | os.PathLike) -> Eagle3Config:
    """The head's config from ``path/config.json``."""
    cfg_file = os.path.join(os.fspath(path), CONFIG_NAME)
    if not os.path.exists(cfg_file):
        raise Eagle3LoadError(f"{os.fspath(path)} has no {CONFIG_NAME}")
    with open(cfg_file) as f:
        return Eagle3Config.from_dict(json.load(f))


def read_eagle3(path: str | os.PathLike, *, dtype: torch.dtype = torch.float32,
                device: str | torch.device = "cpu") -> Eagle3Head:
    """The head stored in ``path`` (config.json + weights), keys and shapes checked strictly.

    Raises ``Eagle3LoadError`` naming every missing and unexpected key and every shape
    mismatch, and any break of the vocabulary-map rule (``check_vocab_map``).
    """
    path = os.fspath(path)
    cfg = read_config(path)
    head = Eagle3Head(cfg)
    state = _read_state(path)
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
