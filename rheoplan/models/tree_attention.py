"""The Triton tree-attention kernel as a transformers attention implementation.

``register()`` adds ``"rheoplan_tree"`` to transformers' ``AttentionInterface`` (the
registry every model's attention layer looks up by ``config._attn_implementation``) and a
mask function that builds no mask (the kernel reads the ancestor bit-words instead of a
dense ``[q, prefix + q]`` mask). ``tree_attention_forward`` is the registered function: it
splits the keys/values the layer holds after its cache update into the cached prefix
(the first ``kv_len - q_len`` entries) and the tree block (the last ``q_len``), and runs
``rheoplan.kernels.tree_attention.triton.tree_attention`` with the tree's ancestor words.

``HFTarget.use_tree_attention(True)`` switches the verify forward to it: during that one
forward the model's ``_attn_implementation`` is ``"rheoplan_tree"`` and the tree's
``TreeAttentionArgs`` travel as the ``rheoplan_tree`` keyword (transformers passes extra
keywords of the model call down to the attention function). Prefill and plain
autoregressive forwards never see it: they keep the model's own attention.

Any head dim (64, 80, 96, 128, the tiny ones of test models): the kernel pads to a power
of two inside; there is no silent fallback to another attention.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass

import torch

#: name under which the kernel is registered in transformers' attention registry
TREE_ATTENTION = "rheoplan_tree"


@dataclass(frozen=True)
class TreeAttentionArgs:
    """What the kernel needs besides q/k/v, for one verify forward (batch 1 or more).

    ``prefix_len [B]`` int64: cached entries before the tree; ``ancestor_bits [B, L, W]``
    int64: row ``i`` has bit ``c % 64`` of word ``c // 64`` set when node ``c`` is ``i`` or
    one of its ancestors (``LinearTree.ancestor_bits`` cut to the ``L`` nodes forwarded).
    """

    prefix_len: torch.Tensor
    ancestor_bits: torch.Tensor
    allow_tf32: bool = False


def tree_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                           value: torch.Tensor, attention_mask: torch.Tensor | None, dropout: float = 0.0,
                           scaling: float | None = None, rheoplan_tree: TreeAttentionArgs | None = None,
                           **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention function: ``query [B, Hq, q, d]``, ``key/value [B, Hkv, P + q, d]``
    (prefix then tree, after the layer's cache update) -> ``([B, q, Hq, d], None)``."""
    if rheoplan_tree is None:
        raise RuntimeError(f"attention implementation {TREE_ATTENTION!r} was called without the "
                           "rheoplan_tree=TreeAttentionArgs(...) keyword: it serves only the verify "
                           "forward of HFTarget (use_tree_attention(True)); other forwards keep the "
                           "model's own attention")
    if kwargs.get("softcap") is not None:
        raise NotImplementedError(f"{TREE_ATTENTION}: logit soft-capping (softcap) is not supported")
    if kwargs.get("sliding_window") is not None:
        raise NotImplementedError(f"{TREE_ATTENTION}: sliding-window layers are not supported")
    if dropout:
        raise NotImplementedError(f"{TREE_ATTENTION}: dropout={dropout} (inference only)")
    from rheoplan.kernels.tree_attention import triton as tk

    q_len = query.shape[2]
    prefix = key.shape[2] - q_len
    out = tk.tree_attention(query, key[:, :, :prefix], value[:, :, :prefix], key[:, :, prefix:],
                            value[:, :, prefix:], rheoplan_tree.prefix_len, rheoplan_tree.ancestor_bits,
                            scale=scaling, allow_tf32=rheoplan_tree.allow_tf32)
    return out.transpose(1, 2), None


def _no_mask(*args, **kwargs) -> None:
    """Mask function for the registry: the kernel takes ancestor words, not a dense mask."""
    return None


def register() -> None:
    """Register ``"rheoplan_tree"`` in transformers' attention and mask registries (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(TREE_ATTENTION, tree_attention_forward)
    AttentionMaskInterface.register(TREE_ATTENTION, _no_mask)


@contextmanager
def tree_attention_active(model: torch.nn.Module):
    """Within the block, ``model`` (and its sub-configs) use ``"rheoplan_tree"``; the previous
    implementation is restored on exit, also on error."""
    register()
    config = model.config
    before = config._attn_implementation
    config._attn_implementation = TREE_ATTENTION
    try:
        yield
    finally:
        config._attn_implementation = before


def check_tree_attention_available(device: torch.device) -> None:
    """Raise a clear error unless the Triton kernel can run for tensors on ``device``:
    CUDA, or the CPU with ``TRITON_INTERPRET=1`` set before Triton was imported."""
    if device.type == "cuda":
        return
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
        return
    raise RuntimeError(f"tree attention runs the Triton kernel: the target is on {device}; allowed a CUDA "
                       "device, or the CPU with TRITON_INTERPRET=1 (the interpreter, for tests)")
