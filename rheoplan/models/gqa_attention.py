"""Masked forwards of grouped-query models without copying the keys and values.

transformers' ``sdpa`` attention lets ``scaled_dot_product_attention`` share each key/value
head among its query heads (``enable_gqa``) only when no mask is passed; with a mask (every
tree verify, a prefill, a batch's padded rows) it first copies every key and value head
``num_key_value_groups`` times (``repeat_kv``), every layer, over the whole cache. On the
CPU that copy is a third of the attention's time: a 9-query, 300-entry attention with 3
key/value heads for 9 query heads took 163 us with the copy and 111 us without it in
bfloat16 (188 / 101 us in float32), and the outputs were bit-identical.

``register()`` adds ``"rheoplan_sdpa_gqa"`` to transformers' ``AttentionInterface``:
``sdpa_gqa_forward`` is one ``scaled_dot_product_attention`` call with the caller's mask
and ``enable_gqa``. ``gqa_attention_active(model, mask, queries)`` switches a model to it
for one forward when it pays: a mask is passed, more than one query per row, the model runs
transformers' ``sdpa`` on the CPU and has fewer key/value heads than query heads. Elsewhere
nothing changes: on a GPU a masked ``enable_gqa`` call can fall back from the fused kernels
to the math one.

Measured on SmolLM2-135M (3 key/value heads for 9 query heads, bfloat16, 2 threads), a
9-token tree verify forward, median of 30 interleaved: 35.7 against 36.7 ms at 100 cached
positions, 38.8 against 40.4 ms at 400 (``docs/results.md``).
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext

import torch

#: name under which ``sdpa_gqa_forward`` is registered in transformers' attention registry
GQA_ATTENTION = "rheoplan_sdpa_gqa"


def sdpa_gqa_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention function: ``query [B, Hq, q, d]``, ``key/value [B, Hkv, kv, d]``,
    ``attention_mask`` the caller's additive mask ``[B or 1, 1, q, kv]`` -> ``([B, q, Hq, d], None)``.
    The same call as transformers' ``sdpa`` with a mask, less the ``repeat_kv`` copy."""
    if attention_mask is None:
        raise RuntimeError(f"attention implementation {GQA_ATTENTION!r} serves masked forwards only "
                           "(gqa_attention_active switches to it when a mask is passed)")
    for name in ("softcap", "position_bias", "sliding_window"):
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"{GQA_ATTENTION}: {name} is not supported")
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask[:, :, :, : key.shape[-2]], dropout_p=dropout, scale=scaling,
        enable_gqa=key.shape[1] != query.shape[1])
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Register ``"rheoplan_sdpa_gqa"`` in transformers' attention and mask registries
    (idempotent); its masks are built as ``sdpa``'s (the callers pass 4D masks, used as is)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(GQA_ATTENTION, sdpa_gqa_forward)
    AttentionMaskInterface.register(GQA_ATTENTION, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


def gqa_pays(model: torch.nn.Module) -> bool:
    """Whether a masked forward of ``model`` should use ``sdpa_gqa_forward``: transformers'
    ``sdpa`` attention, on the CPU, with grouped key/value heads."""
    config = model.config
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    device = next(model.parameters()).device
    return (getattr(config, "_attn_implementation", None) == "sdpa" and device.type == "cpu"
            and heads is not None and kv_heads < heads)


@contextmanager
def _active(config):
    register()
    before = config._attn_implementation
    config._attn_implementation = GQA_ATTENTION
    try:
        yield
    finally:
        config._attn_implementation = before


def gqa_attention_active(model: torch.nn.Module, mask: torch.Tensor | None, queries: int):
    """Context for one forward of ``model`` with ``mask`` and ``queries`` new tokens per row:
    ``sdpa_gqa_forward`` when a mask is passed, ``queries > 1`` and ``gqa_pays(model)``;
    otherwise the model's own attention. With one query per row transformers already avoids
    the copy (it folds the query heads of a group into one), and that measured faster than
    ``enable_gqa``: a batch of 4 one-token rows decoded at 0.90x against 1.01x ``generate``.
    The previous implementation is restored on exit, also on error."""
    if mask is None or queries <= 1 or not gqa_pays(model):
        return nullcontext()
    return _active(model.config)
