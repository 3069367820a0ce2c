"""EAGLE-3 draft heads: the module and its config (``head``), checkpoint I/O
(``checkpoint``), and the ``DraftModel`` adapter with the loader (``draft``).

Load a checkpoint for a transformers target with ``load_eagle3_checkpoint(path, model)``.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch

from rheoplan.models.eagle3.checkpoint import read_eagle3, save_eagle3
from rheoplan.models.eagle3.draft import Eagle3Draft, FeatureSource, load_eagle3_checkpoint
from rheoplan.models.eagle3.head import Eagle3Config, Eagle3Head, Eagle3LoadError, check_vocab_map

__all__ = ["Eagle3Config", "Eagle3Draft", "Eagle3Head", "Eagle3LoadError", "FeatureSource",
           "check_vocab_map", "load_eagle3_checkpoint", "read_eagle3", "save_eagle3"]


def _deprecated(old: str, new: str) -> None:
    warnings.warn(f"{old} is deprecated: use {new}", DeprecationWarning, stacklevel=3)


def load_eagle3_head(path: str | os.PathLike, *, dtype: torch.dtype = torch.float32,
                     device: str | torch.device = "cpu") -> Eagle3Head:
    """Deprecated: use ``read_eagle3`` (the head) or ``load_eagle3_checkpoint`` (a draft)."""
    _deprecated("load_eagle3_head(path)", "read_eagle3(path) or load_eagle3_checkpoint(path, model)")
    return read_eagle3(path, dtype=dtype, device=device)


def load_eagle3_draft(path: str | os.PathLike, target_model: torch.nn.Module, *,
                      dtype: torch.dtype = torch.float32,
                      device: str | torch.device = "cpu") -> Eagle3Draft:
    """Deprecated: use ``load_eagle3_checkpoint(path, model)``."""
    _deprecated("load_eagle3_draft(path, model)", "load_eagle3_checkpoint(path, model)")
    return load_eagle3_checkpoint(path, target_model, dtype=dtype, device=device)


def load_eagle3(path: str | os.PathLike, target_embeddings: Any, *,
                features_from: FeatureSource | None = None, dtype: torch.dtype = torch.float32,
                device: str | torch.device = "cpu") -> Eagle3Draft:
    """Deprecated: use ``load_eagle3_checkpoint(path, embeddings, features_from=...)``."""
    _deprecated("load_eagle3(path, embeddings)", "load_eagle3_checkpoint(path, model or embeddings)")
    return load_eagle3_checkpoint(path, target_embeddings, features_from=features_from, dtype=dtype,
                                  device=device)
