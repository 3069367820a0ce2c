"""Helpers shared by the Hugging Face adapters: masks, cache surgery, base-model calls.

Everything here is batch 1 but ``run_base_rows`` (``rheoplan.models.row_cache`` holds the
batched cache). Cache tensors are ``[1, kv_heads, seq, head_dim]``; the
sequence dimension is ``-2``.
"""

from __future__ import annotations

import inspect

import torch

from rheoplan.kernels.cache_moves import move_columns
from rheoplan.models.gqa_attention import gqa_attention_active, one_query_mask_pays
from rheoplan.models.growing_cache import capacity, grow_in_place, narrow_layer
from rheoplan.models.lean_llama import lean_forward, lean_ok


def forward_memory(cfg, elem: int, vocab: int, batch: int, width: int, queries: int) -> int:
    """Bytes one batched forward of a transformers decoder (config ``cfg``, ``elem``-byte
    weights) holds at most: the KV cache of ``batch`` rows ``width`` columns wide (with the
    spare columns a ``GrowingLayer`` buffer keeps, ``growing_cache.capacity``) and the
    largest activations of ``queries`` new tokens per row (hidden states, the MLP, float32
    mask and scores, float32 logits). A rough upper estimate from the config."""
    layers = int(cfg.num_hidden_layers)
    heads = int(cfg.num_attention_heads)
    kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    inter = int(getattr(cfg, "intermediate_size", 4 * cfg.hidden_size))
    kv = 2 * layers * kv_heads * head_dim * batch * capacity(width) * elem
    act = batch * queries * (4 * cfg.hidden_size + 2 * inter) * elem
    scores = batch * heads * queries * width * 4  # float32 mask + scores
    logits = batch * queries * vocab * 4
    return int(kv + act + 2 * scores + logits)


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Turn a bool ``[q, kv]`` mask into the float ``[1, 1, q, kv]`` mask attention adds.

    Allowed entries are 0, the others the dtype's most negative finite value (not -inf,
    so a fully masked row could never produce NaN in fp16 kernels).

    Example: ``[[True, False]]`` -> ``[[[[0., -3.4e38]]]]`` for float32.
    """
    out = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    out.masked_fill_(~allowed, torch.finfo(dtype).min)
    return out[None, None]


def prefix_and_block_mask(prefix: int, block: torch.Tensor) -> torch.Tensor:
    """Bool mask ``[q, prefix + q]``: every row sees the whole cached prefix, then ``block``.

    Example: prefix 2, block ``[[1,0],[1,1]]`` -> ``[[1,1,1,0],[1,1,1,1]]``.
    """
    q = block.shape[0]
    seen = torch.ones(q, prefix, dtype=torch.bool, device=block.device)
    return torch.cat([seen, block.to(torch.bool)], dim=1)


def base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The decoder stack of a causal LM (``model.model`` for Llama), without the lm_head."""
    prefix = getattr(model, "base_model_prefix", "model")
    base = getattr(model, prefix, None)
    if base is None:
        raise TypeError(f"model {type(model).__name__} has no base model attribute {prefix!r}; "
                        "expected a transformers *ForCausalLM")
    return base


def output_head(model: torch.nn.Module) -> torch.nn.Module:
    """The output projection (lm_head) of a causal LM."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None:
        raise TypeError(f"model {type(model).__name__} has no output embeddings (lm_head)")
    return head


def new_cache(model: torch.nn.Module):
    """An empty dynamic KV cache for ``model`` (transformers 5.x ``DynamicCache``) whose
    full-attention layers append in place (``growing_cache.GrowingLayer``: no copy of the
    whole cache per forward)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    grow_in_place(cache)
    for layer in getattr(cache, "layers", []):
        # Compaction rewrites the sequence dimension in place; a sliding-window layer keeps a
        # window offset that index_select would corrupt, so refuse it before any work.
        if getattr(layer, "is_sliding", False):
            raise NotImplementedError(
                f"model {type(model).__name__} uses sliding-window attention layers; "
                "tree KV compaction supports full-attention layers only")
    return cache


_CACHE_KWARG: dict[type, str] = {}


def _cache_kwarg(base: torch.nn.Module) -> str:
    # transformers 5.x names the argument ``cache``; 4.x called it ``past_key_values``.
    # Memoised per class: inspect.signature costs tens of microseconds, on every forward.
    name = _CACHE_KWARG.get(type(base))
    if name is None:
        params = inspect.signature(base.forward).parameters
        name = _CACHE_KWARG[type(base)] = "cache" if "cache" in params else "past_key_values"
    return name


def run_base(base: torch.nn.Module, cache, input_ids: torch.Tensor, position_ids: torch.Tensor,
             allowed: torch.Tensor | None, all_allowed: bool | None = None, **attention_kwargs) -> torch.Tensor:
    """One forward of the decoder stack; appends to ``cache``; returns hidden ``[q, H]``.

    ``allowed`` is the bool mask ``[q, cached + q]`` (rows: new tokens, columns: cached then
    new entries); it is passed as a 4D additive mask so any tree shape works. ``None`` passes
    no mask: only for an attention implementation that gets its mask another way (the tree
    attention kernel reads ``attention_kwargs["rheoplan_tree"]``, which transformers hands
    down to every attention call). ``all_allowed``: whether every entry of ``allowed`` is
    True, when the caller knows it (None: read from ``allowed``, a device-to-host sync).
    """
    if all_allowed is None:
        all_allowed = allowed is None or bool(allowed.all())
    if all_allowed and input_ids.shape[-1] == 1 and one_query_mask_pays(base):
        # A one-token step whose attention measured faster with an all-zero mask than with
        # none (transformers' folded one-query path; ``one_query_mask_pays``).
        mask = torch.zeros(1, 1, 1, cache.get_seq_length() + 1, dtype=next(base.parameters()).dtype,
                           device=input_ids.device)
    elif allowed is None or all_allowed:
        # None: the tree-attention kernel reads its mask elsewhere. All allowed (a one-token
        # step): no mask lets attention take its unmasked path, as ``generate`` does.
        mask = None
    else:
        mask = additive_mask(allowed, next(base.parameters()).dtype)
    return _forward(base, cache, input_ids[None], position_ids[None], mask, attention_kwargs)[0]


def run_base_rows(base: torch.nn.Module, cache, input_ids: torch.Tensor, position_ids: torch.Tensor,
                  allowed: torch.Tensor, **attention_kwargs) -> torch.Tensor:
    """``run_base`` for B rows: ``input_ids`` / ``position_ids`` ``[B, q]``, ``allowed`` the
    bool mask ``[B, q, cached + q]``; returns hidden ``[B, q, H]``. Every query row must
    allow at least one column (a fully masked row would be NaN in some kernels)."""
    dtype = next(base.parameters()).dtype
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return _forward(base, cache, input_ids, position_ids, mask[:, None], attention_kwargs)


def _forward(base: torch.nn.Module, cache, input_ids: torch.Tensor, position_ids: torch.Tensor,
             mask: torch.Tensor | None, attention_kwargs: dict) -> torch.Tensor:
    """The decoder stack over ``input_ids`` / ``position_ids`` ``[B, q]`` with the additive
    ``mask`` (or None); hidden ``[B, q, H]``. A Llama runs ``lean_llama.lean_forward`` (the
    same operations without transformers' per-layer dispatch), any other model its own
    forward."""
    with gqa_attention_active(base, mask, input_ids.shape[-1]):  # no repeat_kv copy of the cache (CPU sdpa)
        if lean_ok(base):
            return lean_forward(base, input_ids, position_ids, mask, cache, **attention_kwargs)
        out = base(input_ids=input_ids, position_ids=position_ids, attention_mask=mask,
                   use_cache=True, **{_cache_kwarg(base): cache}, **attention_kwargs)
    return out.last_hidden_state


def _layer_tensors(cache) -> list[tuple[object, str, str]]:
    """(holder, key attr, value attr) per layer, for 5.x layer objects or 4.x lists."""
    if hasattr(cache, "layers"):
        return [(layer, "keys", "values") for layer in cache.layers]
    raise TypeError(f"unsupported cache type {type(cache).__name__}: expected a transformers "
                    "DynamicCache with .layers (transformers >= 5)")


def cache_length(cache) -> int:
    """Number of cached positions (0 for a fresh cache)."""
    return int(cache.get_seq_length())


def select_cache(cache, keep: torch.Tensor) -> None:
    """Keep only sequence entries ``keep`` (int64, in that order) of every layer, in place."""
    for holder, k, v in _layer_tensors(cache):
        keys = getattr(holder, k)
        if keys is None or keys.numel() == 0:
            continue
        idx = keep.to(keys.device)
        setattr(holder, k, keys.index_select(-2, idx))
        setattr(holder, v, getattr(holder, v).index_select(-2, idx))


def crop_cache(cache, length: int) -> None:
    """Drop every cached entry at or after ``length``, in place (a view: nothing is copied)."""
    if cache_length(cache) > length:
        for holder, k, v in _layer_tensors(cache):
            keys = getattr(holder, k)
            if keys is None or keys.numel() == 0:
                continue
            narrow_layer(holder, length)


def commit_cache(cache, prefix: int, path: "list[int] | torch.Tensor") -> None:
    """Keep the ``prefix`` cached entries and the tree entries ``prefix + path[j]`` (moved
    to ``prefix + j``), drop the rest, in place.

    Only the tree's part moves, so a commit costs O(tree), not O(context) like an
    ``index_select`` of the whole cache. A list ``path`` moves with
    ``rheoplan.kernels.cache_moves.move_columns`` (one numba call per CPU tensor where the
    path runs forward, as a root-to-node path does; torch's gather elsewhere); every
    source is read before it is overwritten, so the order of ``path`` does not matter.

    Example: prefix 3, path [0, 2, 5] keeps entries 0, 1, 2 and moves 3 -> 3, 5 -> 4, 8 -> 5.

    ``path`` may be an int64 tensor on the cache's device (offsets only the device knows):
    then every entry is moved, since skipping those already in place would need a host read.
    """
    n = len(path)
    on_device = isinstance(path, torch.Tensor)
    moves = on_device and n > 0 or not on_device and any(p != j for j, p in enumerate(path))
    held = []
    for holder, k, v in _layer_tensors(cache):
        keys = getattr(holder, k)
        if keys is None or keys.numel() == 0:
            continue
        held.append((holder, keys, getattr(holder, v)))
    if moves and on_device:
        on = {}  # the moves on each device the layers live on (moved there once, not per layer)
        for _, keys, vals in held:
            if keys.device not in on:
                on[keys.device] = (prefix + torch.arange(n, device=keys.device), prefix + path.to(keys.device))
            dst, src = on[keys.device]
            keys.index_copy_(-2, dst, keys.index_select(-2, src))
            vals.index_copy_(-2, dst, vals.index_select(-2, src))
    elif moves and held:
        move_columns([(keys, vals) for _, keys, vals in held], prefix, [list(path)] * held[0][1].shape[0])
    for holder, _, _ in held:
        narrow_layer(holder, prefix + n)
