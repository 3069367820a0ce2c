"""Model adapters: the ``TargetModel`` / ``DraftModel`` interfaces and their implementations.

``as_target`` / ``as_draft`` wrap what a user has (a ``FunctionalLM``, a transformers causal
LM, or an adapter already) into the adapter the decode loop expects.

Public names: the interfaces ``TargetModel``, ``DraftModel``, ``TreeLogits``; functional
models ``FunctionalLM``, ``hashed_context_lm``; the adapters ``FunctionalTarget``,
``FunctionalDraft``, ``HFTarget``, ``HFDraft``, ``Eagle3Draft``; ``as_target``,
``as_draft``; the EAGLE-3 loader ``load_eagle3_checkpoint``.

Example:
    >>> from rheoplan.models import as_target, hashed_context_lm
    >>> target = as_target(hashed_context_lm(8, seed=0))
    >>> type(target).__name__
    'FunctionalTarget'
"""

from __future__ import annotations

from typing import Any

from rheoplan.models.base import DraftModel, TargetModel, TreeLogits
from rheoplan.models.eagle3 import Eagle3Draft, load_eagle3_checkpoint
from rheoplan.models.functional import (FunctionalDraft, FunctionalLM, FunctionalTarget,
                                        hashed_context_lm)
from rheoplan.models.hf_draft import HFDraft
from rheoplan.models.hf_target import HFTarget
from rheoplan.models.packed_linear import pack_if_it_pays, pack_linears, unpack_linears

__all__ = ["DraftModel", "TargetModel", "TreeLogits", "FunctionalLM", "hashed_context_lm",
           "FunctionalTarget", "FunctionalDraft", "HFTarget", "HFDraft", "Eagle3Draft",
           "load_eagle3_checkpoint", "as_draft", "as_target", "pack_if_it_pays", "pack_linears",
           "unpack_linears"]


def _is_hf_causal_lm(model: Any) -> bool:
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return False
    return isinstance(model, PreTrainedModel) and model.get_output_embeddings() is not None


def as_target(model: Any, **kwargs: Any) -> TargetModel:
    """A ``TargetModel`` for ``model``: FunctionalLM -> FunctionalTarget, transformers
    causal LM -> HFTarget (``kwargs`` such as ``capture_layers`` go to it), adapters as is.

    An HF target captures EAGLE-3 features by default (when it has >= 4 layers), so an
    ``Eagle3Draft`` works whatever draft the caller pairs it with; capturing only keeps
    references to three layer inputs and concatenates them once per forward.
    """
    if isinstance(model, FunctionalLM):
        return FunctionalTarget(model)
    if _is_hf_causal_lm(model):
        if "capture_layers" not in kwargs and len(getattr(model.base_model, "layers", ())) >= 4:
            kwargs["capture_layers"] = "eagle3"
        return HFTarget(model, **kwargs)
    if isinstance(model, TargetModel):
        return model
    raise TypeError(f"cannot use {type(model).__name__} as a target: allowed FunctionalLM, a "
                    "transformers *ForCausalLM, or an object implementing TargetModel")


def as_draft(model: Any, **kwargs: Any) -> DraftModel:
    """A ``DraftModel`` for ``model``: FunctionalLM -> FunctionalDraft, transformers causal
    LM -> HFDraft, adapters (e.g. ``Eagle3Draft``) as is."""
    if isinstance(model, FunctionalLM):
        return FunctionalDraft(model)
    if _is_hf_causal_lm(model):
        return HFDraft(model, **kwargs)
    if isinstance(model, DraftModel):
        return model
    raise TypeError(f"cannot use {type(model).__name__} as a draft: allowed FunctionalLM, a "
                    "transformers *ForCausalLM, or an object implementing DraftModel "
                    "(an EAGLE-3 head needs load_eagle3_checkpoint / Eagle3Draft)")
