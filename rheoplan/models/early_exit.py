"""A draft that needs no training: the target's own first layers (early exit).

``early_exit_draft(model, layers)`` builds a causal LM that shares the target's token
embeddings, its first ``layers`` decoder layers, its final norm and its lm_head (no
weights are copied). It proposes what the target would say if it stopped thinking
after ``layers`` layers: a weak but honest draft that exists for every model, used
by the CLI until a trained EAGLE-3 head is available.
"""

from __future__ import annotations

import copy

import torch


def _shallow(module: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``module`` whose child/parameter tables are new dicts over the same objects,
    so replacing a child on the copy leaves the original untouched."""
    out = copy.copy(module)
    out._modules = dict(module._modules)
    out._parameters = dict(module._parameters)
    out._buffers = dict(module._buffers)
    return out


def early_exit_draft(model: torch.nn.Module, layers: int) -> torch.nn.Module:
    """A shallow view of ``model`` (a transformers Llama-family causal LM) with ``layers`` layers.

    Example:
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> m = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
        ...                      num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=2))
        >>> early_exit_draft(m, 2).config.num_hidden_layers
        2
    """
    total = getattr(model.config, "num_hidden_layers", None)
    if total is None or not hasattr(getattr(model, "model", None), "layers"):
        raise TypeError(f"early_exit_draft needs a Llama-family causal LM with model.layers, "
                        f"got {type(model).__name__}")
    if isinstance(layers, bool) or not isinstance(layers, int) or not 1 <= layers < total:
        raise ValueError(f"layers={layers!r} is out of range: allowed an int in [1, {total - 1}]")
    draft = _shallow(model)  # shares every parameter tensor
    draft.model = _shallow(model.model)
    draft.model.layers = torch.nn.ModuleList(list(model.model.layers[:layers]))
    draft.config = copy.deepcopy(model.config)
    draft.config.num_hidden_layers = layers
    draft.model.config = draft.config
    if hasattr(draft.config, "layer_types") and draft.config.layer_types is not None:
        draft.config.layer_types = list(draft.config.layer_types)[:layers]
    return draft
