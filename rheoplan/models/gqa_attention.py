"""Masked forwards of grouped-query models without copying the keys and values.

transformers' ``sdpa`` attention lets ``scaled_dot_product_attention`` share each key/value
head among its query heads (``enable_gqa``) only when no mask is passed; with a mask (every
tree verify, a prefill, a batch's padded rows) it first copies every key and value head
``num_key_value_groups`` times (``repeat_kv``), every layer, over the whole cache. On the
CPU that copy is a third of the attention's time: a 9-query, 300-entry attention with 3
key/value heads for 9 query heads took 163 us with the copy and 111 us without it in
bfloat16 (188 / 101 us in float32), and the outputs were bit-identical.

``register()`` adds two functions to transformers' ``AttentionInterface``, both one
``scaled_dot_product_attention`` call with the caller's mask and no copy:

* ``"rheoplan_sdpa_gqa"`` (``sdpa_gqa_forward``): ``enable_gqa``. Bit-identical to
  transformers' ``sdpa``.
* ``"rheoplan_sdpa_fold"`` (``sdpa_fold_forward``): each key/value head's query heads
  folded into its query axis, the mask's rows repeated once per group member (what
  transformers itself does for one masked query, extended to several). The same attention,
  and on the 2-core Zen 5 AMD EPYC in bfloat16 much faster for batches: 4 rows of 3 tree
  tokens over 150 cached entries 107 against 66 us a layer, 16 rows over 200 558 against
  300; for one row only a little (9 tokens over 400 entries 98 against 90 us), and inside
  decodes one row's tree verify forwards were not faster (``docs/results.md``,
  "Twenty-fifth round"). Its sums can be grouped differently from ``enable_gqa``'s by the
  kernel, so outputs agree up to rounding (the last bit of some entries), like the packed
  and merged products of ``rheoplan.models.packed_linear``.

``gqa_attention_active(model, mask, queries)`` switches a model to one of them for one
forward when it pays: a mask is passed, more than one query per row, the model runs
transformers' ``sdpa`` on the CPU and has fewer key/value heads than query heads; which of
the two is measured once per process and attention shape (``fold_timings``). Elsewhere
nothing changes: on a GPU a masked ``enable_gqa`` call can fall back from the fused kernels
to the math one.

Measured on SmolLM2-135M (3 key/value heads for 9 query heads, bfloat16, 2 threads), a
9-token tree verify forward, median of 30 interleaved: 35.7 against 36.7 ms at 100 cached
positions, 38.8 against 40.4 ms at 400 for ``enable_gqa`` against the copy
(``docs/results.md``).

One query per row without a mask (a one-token step of one sequence) is the opposite case:
there transformers takes ``enable_gqa``, which on some CPUs is several times slower than
its own masked one-query path. ``one_query_mask_pays`` measures the two once per process
and attention shape, and ``run_base`` passes an all-zero mask where the masked path wins.
"""

from __future__ import annotations

import time
import weakref
from contextlib import contextmanager, nullcontext

import torch

#: name under which ``sdpa_gqa_forward`` is registered in transformers' attention registry
GQA_ATTENTION = "rheoplan_sdpa_gqa"
#: name under which ``sdpa_fold_forward`` is registered
FOLD_ATTENTION = "rheoplan_sdpa_fold"


def _check_call(name: str, attention_mask: torch.Tensor | None, kwargs: dict) -> None:
    if attention_mask is None:
        raise RuntimeError(f"attention implementation {name!r} serves masked forwards only "
                           "(gqa_attention_active switches to it when a mask is passed)")
    for arg in ("softcap", "position_bias", "sliding_window"):
        if kwargs.get(arg) is not None:
            raise NotImplementedError(f"{name}: {arg} is not supported")


def sdpa_gqa_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention function: ``query [B, Hq, q, d]``, ``key/value [B, Hkv, kv, d]``,
    ``attention_mask`` the caller's additive mask ``[B or 1, 1 or Hq, q, kv]`` ->
    ``([B, q, Hq, d], None)``. The same call as transformers' ``sdpa`` with a mask, less the
    ``repeat_kv`` copy."""
    _check_call(GQA_ATTENTION, attention_mask, kwargs)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask[:, :, :, : key.shape[-2]], dropout_p=dropout, scale=scaling,
        enable_gqa=key.shape[1] != query.shape[1])
    return out.transpose(1, 2).contiguous(), None


# The folded mask of the forward in flight (every layer of a forward gets the same mask
# object): one repeat per forward instead of one per layer (~10 us each). One entry, held
# as (weak reference to the caller's mask, (length, groups, the mask's version counter),
# folded mask) and read in one step, so concurrent forwards at worst fold again; a mask
# written in place between two calls is folded again, and the entry goes with its mask.
_FOLDED: list = [None]


def _forget(ref) -> None:
    entry = _FOLDED[0]
    if entry is not None and entry[0] is ref:
        _FOLDED[0] = None


def folded_mask(attention_mask: torch.Tensor, kv: int, groups: int) -> torch.Tensor:
    """``attention_mask [B or 1, 1, q, >= kv]`` -> ``[B or 1, 1, groups * q, kv]``, row
    ``j * q + t`` = row ``t`` (``j`` the query head's place in its group); memoised for the
    last mask object, length, group size and version."""
    entry = _FOLDED[0]
    stamp = (kv, groups, attention_mask._version)
    if entry is not None and entry[0]() is attention_mask and entry[1] == stamp:
        return entry[2]
    out = attention_mask[:, :, :, :kv].repeat(1, 1, groups, 1)
    _FOLDED[0] = (weakref.ref(attention_mask, _forget), stamp, out)
    return out


def sdpa_fold_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      **kwargs) -> tuple[torch.Tensor, None]:
    """``sdpa_gqa_forward``'s attention, each key/value head's ``g`` query heads folded into
    its query axis: ``query [B, Hq, q, d]`` is read as ``[B, Hkv, g * q, d]`` (query head
    ``h`` serves key/value head ``h // g``, as transformers' ``repeat_kv`` pairs them) and
    the mask's rows are repeated ``g`` times, so one attention per key/value head needs no
    ``enable_gqa``. A mask with a head axis (``[B, Hq, q, kv]``) cannot fold: that call is
    ``sdpa_gqa_forward``'s."""
    _check_call(FOLD_ATTENTION, attention_mask, kwargs)
    B, Hq, q, d = query.shape
    Hkv, kv = key.shape[1], key.shape[-2]
    if Hkv == Hq or attention_mask.shape[1] != 1:
        return sdpa_gqa_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    g = Hq // Hkv
    out = torch.nn.functional.scaled_dot_product_attention(
        query.reshape(B, Hkv, g * q, d), key, value, attn_mask=folded_mask(attention_mask, kv, g),
        dropout_p=dropout, scale=scaling)
    return out.view(B, Hq, q, d).transpose(1, 2).contiguous(), None


def register() -> None:
    """Register ``"rheoplan_sdpa_gqa"`` and ``"rheoplan_sdpa_fold"`` in transformers'
    attention and mask registries (idempotent); their masks are built as ``sdpa``'s (the
    callers pass 4D masks, used as is)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    for name, fn in ((GQA_ATTENTION, sdpa_gqa_forward), (FOLD_ATTENTION, sdpa_fold_forward)):
        AttentionInterface.register(name, fn)
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


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
    return _cpu_shape(model) is not None


def _cpu_shape(model: torch.nn.Module) -> tuple | None:
    """``attention_shape(model)`` where ``gqa_pays`` holds, else None (one read of the
    model: each costs ~7 us, and a masked forward asks before it runs)."""
    shape = attention_shape(model)
    return shape if shape is not None and torch.device(shape[1]).type == "cpu" else None


@contextmanager
def _active(config, name: str):
    register()
    before = config._attn_implementation
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = before


def gqa_attention_active(model: torch.nn.Module, mask: torch.Tensor | None, queries: int):
    """Context for one forward of ``model`` with ``mask`` and ``queries`` new tokens per row:
    when a mask is passed, ``queries > 1`` and ``gqa_pays(model)``, ``sdpa_fold_forward``
    where it measured faster for the mask's rows (``fold_pays``; ``mask [rows, 1, q, kv]``),
    else ``sdpa_gqa_forward``; otherwise the model's own attention. With one query per row
    transformers already avoids the copy (it folds the query heads of a group into one),
    and that measured faster than ``enable_gqa``: a batch of 4 one-token rows decoded at
    0.90x against 1.01x ``generate``.
    The previous implementation is restored on exit, also on error."""
    if mask is None or queries <= 1 or not gqa_pays(model):
        return nullcontext()
    return _active(model.config, FOLD_ATTENTION if fold_pays(model, mask.shape[0]) else GQA_ATTENTION)


# -- several queries, a mask: fold the query heads or enable_gqa ----------------------------

_FOLD: dict[tuple, dict[int, tuple[float, float]]] = {}
#: the shapes ``fold_timings`` times, (rows, queries per row, cached entries): one row's tree
#: verify, and a batch's
FOLD_PROBES = ((1, 8, 256), (4, 3, 256))
#: how much faster the fold must measure to be taken. At one row on the 2-core Zen 5 AMD EPYC
#: (bfloat16) the fold measured 15% faster alone, yet a decode's tree verify forwards took
#: 0.19 ms longer with it (the folded query is a copy, one per layer; "Twenty-fifth round"):
#: below this margin a call's own gain does not survive the forward around it.
FOLD_MARGIN = 0.75


def fold_timings(model: torch.nn.Module, reps: int = 20) -> dict[int, tuple[float, float]] | None:
    """Microseconds of ``sdpa_gqa_forward`` and ``sdpa_fold_forward`` at ``model``'s
    attention shape, by rows, for each of ``FOLD_PROBES`` (a causal block over the new
    entries, the query in the layout a decoder layer hands over), the best of ``reps``
    alternating runs each; memoised per shape. None when the model does not run ``sdpa``
    with grouped heads on the CPU (``gqa_pays``: nothing to choose)."""
    key = _cpu_shape(model)
    if key is None:
        return None
    if key not in _FOLD:
        dtype, device, heads, kv_heads, head_dim = key
        module = _Group(heads // kv_heads)
        g = torch.Generator().manual_seed(0)
        out = {}
        with torch.no_grad():
            for rows, q, cached in FOLD_PROBES:
                # [rows, heads, q, d] as a transposed view, like the layers' queries
                query = torch.randn(rows, q, heads, head_dim, generator=g).to(device, dtype).transpose(1, 2)
                k, v = (torch.randn(rows, kv_heads, cached + q, head_dim, generator=g).to(device, dtype)
                        for _ in range(2))
                mask = torch.zeros(rows, 1, q, cached + q, dtype=dtype, device=device)
                mask[..., cached:].masked_fill_(torch.ones(q, q, dtype=torch.bool).triu(1), torch.finfo(dtype).min)
                best = [float("inf"), float("inf")]
                for _ in range(reps + 1):
                    for i, fn in enumerate((sdpa_gqa_forward, sdpa_fold_forward)):
                        t0 = time.perf_counter()
                        fn(module, query, k, v, mask)
                        best[i] = min(best[i], time.perf_counter() - t0)
                out[rows] = (1e6 * best[0], 1e6 * best[1])
        _FOLD[key] = out
    return _FOLD[key]


def _fold_probe(rows: int) -> int:
    """The probe's row count that stands for a forward of ``rows`` rows: one, or a batch."""
    return 1 if rows == 1 else max(r for r, _, _ in FOLD_PROBES)


def fold_pays(model: torch.nn.Module, rows: int) -> bool:
    """Whether a masked several-query forward of ``rows`` rows of ``model`` should fold the
    query heads (``sdpa_fold_forward``) rather than use ``enable_gqa``: measured
    (``fold_timings``, the one-row probe for one row, the batch probe for more), and only
    where the fold takes at most ``FOLD_MARGIN`` of the time."""
    t = fold_timings(model)
    if t is None:
        return False
    gqa_us, fold_us = t[_fold_probe(rows)]
    return fold_us <= FOLD_MARGIN * gqa_us


def fold_note(model: torch.nn.Module) -> str | None:
    """One line saying how ``model``'s masked several-query forwards attend and the
    measurements behind it (None when there is nothing to choose)."""
    t = fold_timings(model)
    if t is None:
        return None
    parts = []
    for rows, q, _ in FOLD_PROBES:
        how = "fold each group's query heads" if fold_pays(model, rows) else "enable_gqa"
        label = "one row" if rows == 1 else "batches"
        parts.append(f"{label} {how} ({rows}x{q} queries: {t[rows][0]:.0f} us with enable_gqa, "
                     f"{t[rows][1]:.0f} folded)")
    return "masked forwards of several tokens: " + "; ".join(parts)


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
