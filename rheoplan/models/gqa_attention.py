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

One query per row without a mask (a one-token step of one sequence) is the opposite case:
there transformers takes ``enable_gqa``, which on some CPUs is several times slower than
its own masked one-query path. ``one_query_mask_pays`` measures the two once per process
and attention shape, and ``run_base`` passes an all-zero mask where the masked path wins.
"""

from __future__ import annotations

import time
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


def attention_shape(model: torch.nn.Module) -> tuple | None:
    """``(dtype, device, heads, kv_heads, head_dim)`` of ``model``'s attention, None when it
    does not run transformers' ``sdpa`` with grouped key/value heads."""
    config = model.config
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if getattr(config, "_attn_implementation", None) != "sdpa" or heads is None or kv_heads >= heads:
        return None
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    p = next(model.parameters())
    return p.dtype, str(p.device), int(heads), int(kv_heads), int(head_dim)


def gqa_pays(model: torch.nn.Module) -> bool:
    """Whether a masked forward of ``model`` should use ``sdpa_gqa_forward``: transformers'
    ``sdpa`` attention, on the CPU, with grouped key/value heads."""
    shape = attention_shape(model)
    return shape is not None and torch.device(shape[1]).type == "cpu"


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


# -- one query, no mask ---------------------------------------------------------------------
# A one-token step over a whole cache needs no mask, and ``run_base`` passes none, as
# ``generate`` does. transformers' ``sdpa`` then takes ``enable_gqa``; with a mask (any
# mask) and one query it instead folds each group's query heads into one query axis
# (``pack_gqa``). The two are the same attention, rounded differently, and on some CPUs
# far apart: on the 2-core AMD EPYC in bfloat16, 9 query heads over 3 key/value heads and
# 600 cached positions took 0.29 against 0.06 ms per layer, and a SmolLM2-135M one-token
# forward 23.3 ms without a mask against 17.0 with an all-zero one (docs/results.md); in
# float32 the two measured the same. So whether a one-token step passes an all-zero mask
# is measured, once per process and attention shape.

_ONE_QUERY: dict[tuple, tuple[float, float]] = {}


class _Group(torch.nn.Module):
    """Stands in for an attention module in a bare ``sdpa_attention_forward`` call."""

    is_causal = True

    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups = groups


def one_query_timings(model: torch.nn.Module, cached: int = 256, reps: int = 30) -> tuple[float, float] | None:
    """Microseconds of one attention call of ``model``'s shape (one query per head, ``cached``
    key/value positions, transformers' ``sdpa_attention_forward``) without a mask and with an
    all-zero one, the best of ``reps`` alternating runs each; memoised per shape. None when
    the model does not run ``sdpa`` with grouped heads (nothing to choose)."""
    key = attention_shape(model)
    if key is None:
        return None
    if key not in _ONE_QUERY:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        dtype, device, heads, kv_heads, head_dim = key
        g = torch.Generator().manual_seed(0)
        q = torch.randn(1, heads, 1, head_dim, generator=g).to(device, dtype)
        k, v = (torch.randn(1, kv_heads, cached, head_dim, generator=g).to(device, dtype) for _ in range(2))
        zero = torch.zeros(1, 1, 1, cached, dtype=dtype, device=device)
        module = _Group(heads // kv_heads)
        best = [float("inf"), float("inf")]
        with torch.no_grad():
            for _ in range(reps + 1):
                for i, mask in enumerate((None, zero)):
                    t0 = time.perf_counter()
                    sdpa_attention_forward(module, q, k, v, mask)
                    if q.device.type == "cuda":
                        torch.cuda.synchronize(q.device)
                    best[i] = min(best[i], time.perf_counter() - t0)
        _ONE_QUERY[key] = (1e6 * best[0], 1e6 * best[1])
    return _ONE_QUERY[key]


def one_query_mask_pays(model: torch.nn.Module) -> bool:
    """Whether a one-token forward of ``model`` should pass an all-zero mask (transformers'
    folded one-query attention) rather than none (``enable_gqa``): measured
    (``one_query_timings``), and only when the mask is at least 20% faster, so that where
    the two are close a step keeps the path ``generate`` takes."""
    t = one_query_timings(model)
    return t is not None and t[1] < 0.8 * t[0]


def one_query_note(model: torch.nn.Module) -> str | None:
    """One line saying how ``model``'s one-token steps attend and the measurement behind it
    (None when there is nothing to choose)."""
    t = one_query_timings(model)
    if t is None:
        return None
    how = ("pass an all-zero mask (transformers' folded one-query attention)" if one_query_mask_pays(model)
           else "pass no mask, as generate does")
    return f"one-token steps {how}: attention measured {t[0]:.0f} us without a mask, {t[1]:.0f} us with one"
