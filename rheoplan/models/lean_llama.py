"""A Llama decoder forward without transformers' per-layer dispatch: the same operations,
the same order, the same bits.

Why: SmolLM2-135M is small enough that transformers' own Python around each decoder layer
is a tenth of a forward on a 2-core CPU. ``LlamaModel.forward`` runs its decorators and
builds its mask once, then for each of the 30 layers calls ``LlamaDecoderLayer``,
``LlamaAttention`` and ``LlamaMLP`` through ``nn.Module.__call__`` with keyword arguments
handed down three levels (``deprecate_kwarg`` wrappers included), and every norm and
projection through ``__call__`` too. On the 2-core Zen 5 AMD EPYC (bfloat16, packed
weights, ~150 cached tokens, alternating calls) the decoder took 0.65 ms less a forward
with the containers inlined, 0.4 ms less again with the leaves' ``forward`` called
directly, 0.35 ms less again with the rotary embedding applied to the queries and keys
as one tensor (12.0 against 13.9 ms for one token, 14.5 against 16.2 ms for a 9-token
tree, in one run of the three together), and 0.1 ms less again with its half-rotation as
one ``roll``; bit-identical hidden states at every step (docs/results.md, "Twenty-eighth round", has the decode-level
numbers).

``lean_forward`` is ``LlamaModel.forward`` inlined: the embedding, transformers' own
``create_causal_mask`` and rotary embedding (called once, as there), then per layer the
norms, the projections, the rotary embedding (``apply_rotary_pos_emb``'s formula, written
out once for the queries and keys together, its ``rotate_half(x) * sin`` as ``roll(x) *
sin`` with the first half of ``sin`` negated: the same float operations on every entry),
``cache.update`` and the attention function registered under the config's
``_attn_implementation`` (what ``gqa_attention_active`` switched it to for this forward),
called with the arguments transformers passes. Every module's own ``forward`` runs (a
patched norm's too); only ``__call__`` is skipped, so no hook may be on them.

``lean_ok(base)`` says whether that is the same computation: exactly transformers' 5.x
``LlamaModel`` / ``LlamaDecoderLayer`` / ``LlamaAttention`` / ``LlamaMLP`` classes (a
subclass may override a forward), its own ``apply_rotary_pos_emb`` (a kernel library may
patch it), no forward hook on any module it calls but the feature capture's
(``capture_hook``: a forward pre-hook on a decoder layer that reads its input and changes
nothing, which ``lean_forward`` calls itself), no global module hooks, not training, and
no gradient being recorded, no ``forward`` set on an inlined container's instance (a spy,
accelerate's hooks). Anything else runs transformers' forward, as before;
``tests/rheoplan/models/test_lean_llama.py`` checks both against each other, bit for bit
(float32 and bfloat16, plain and packed weights, one row and several, the captured
features), and that a foreign hook sends the forward back to transformers.

With its glue fused (``fuse_glue``: bfloat16 forwards of at most ``GLUE_MAX_ROWS`` tokens)
the norms, residual sums and rotary embedding run as numba kernels instead
(``rheoplan.kernels.decoder_glue``): one call each instead of eight operators for a norm,
the same bits (the same tests, fused). There, where a layer's q / k / v projections share
one product (``packed_linear.shared_product``) and its cache layer is a ``GrowingLayer``
with room for the new columns, the product runs once and one kernel call ropes the queries
and writes the roped keys and the values straight into the cache's buffers
(``_rope_into_cache``, ``glue.rope_qkv_append``): the same entries, the queries in the same
strided view, instead of ~20 small calls a layer. Where each of a layer's four products (q | k
| v, o, gate | up, down) is the few-row kernel's bfloat16 product alone
(``packed_linear.bfloat16_kernel_span``), ``_product_into`` launches the kernel itself
(``kernels.linear.cpu.bfloat16_rows_into``) into an output this thread reuses, without
``PackedLinear.forward``'s checks and conversions (a one-row call took 20 us in a tight loop,
4 of them the launch; 120 products a forward): the same kernel call, the same bits.
"""

from __future__ import annotations

import functools
import threading
import weakref
from operator import attrgetter

import numpy as np
import torch
from torch.nn.modules import module as torch_module

from rheoplan.kernels import decoder_glue as glue
from rheoplan.kernels.linear.cpu import bfloat16_rows_into
from rheoplan.models.growing_cache import growing_layers
from rheoplan.models.packed_linear import bfloat16_kernel_span, pack_count, shared_product

#: set to False to run every forward through transformers (A/B measurements, debugging)
ENABLED = True

#: set to False to run the fused glue's queries, keys and values as separate calls and
#: ``cache.update`` instead of ``_rope_into_cache``'s one call (A/B measurements)
QKV_APPEND = True

#: marks a decoder-layer forward pre-hook that only reads the layer's input
#: (``HFTarget``'s feature capture); ``lean_forward`` calls such hooks itself
CAPTURE_HOOK = "_rheoplan_reads_input_only"


def capture_hook(fn):
    """Mark ``fn`` (a ``register_forward_pre_hook(..., with_kwargs=True)`` hook that reads the
    layer's input and returns None) as safe for ``lean_forward``, which then calls it with
    ``(layer, (hidden,), {})`` where transformers would have."""
    setattr(fn, CAPTURE_HOOK, True)
    return fn


@functools.lru_cache(maxsize=1)
def _llama_classes():
    """transformers' Llama module, or None where ``lean_forward`` does not mirror it: it
    inlines the 5.x forwards (4.x layers return tuples and name the cache differently)."""
    try:
        import transformers
        from transformers.models.llama import modeling_llama as ml
    except ImportError:  # no transformers: nothing is lean
        return None
    return ml if int(transformers.__version__.split(".")[0]) >= 5 else None


_FORWARD_HOOKS = attrgetter("_forward_hooks")
_FORWARD_PRE_HOOKS = attrgetter("_forward_pre_hooks")


def _hook_free(mods: tuple) -> bool:
    # backward hooks cannot fire (lean_ok asks for no gradient recording); map / any loop
    # in C: 8 us for SmolLM2's ~300 modules against 30 in a Python loop
    return not (any(map(_FORWARD_HOOKS, mods)) or any(map(_FORWARD_PRE_HOOKS, mods)))


def _only_capture_hooks(layer: torch.nn.Module) -> bool:
    return not layer._forward_hooks and (not layer._forward_pre_hooks or all(
        getattr(h, CAPTURE_HOOK, False) for h in layer._forward_pre_hooks.values()))


def _skipped(base: torch.nn.Module, ml) -> tuple | None:
    """``(layers, containers, modules)`` as ``base`` holds them now: the decoder layers, the
    modules whose ``forward`` ``lean_forward`` inlines (the model, the layers, their
    attention and MLP) and every module whose ``__call__`` it skips (those and their
    children: norms, projections, the activation); None where a container is not
    transformers' own Llama class. Walked afresh on every check, through the ``_modules``
    dicts (``lean_ok`` takes ~40 us in all for SmolLM2), not cached per model: the loader runs
    forwards before it swaps the linear layers for packed ones, and a cache would then
    check the hooks of modules the model no longer holds."""
    ms = base._modules
    n = base.config.num_hidden_layers
    layers = list(ms["layers"]._modules.values())[:n]
    if len(layers) < n:
        return None
    containers = [base]
    mods = [base, ms["embed_tokens"], ms["rotary_emb"], ms["norm"]]
    for x in layers:
        xm = x._modules
        a, m = xm.get("self_attn"), xm.get("mlp")
        if type(x) is not ml.LlamaDecoderLayer or type(a) is not ml.LlamaAttention or type(m) is not ml.LlamaMLP:
            return None
        containers += (x, a, m)
        mods += (a, m, xm["input_layernorm"], xm["post_attention_layernorm"], *a._modules.values(),
                 *m._modules.values())
    return layers, containers, mods


def _standard_rope(ml) -> bool:
    """Whether transformers' Llama rotary embedding is its own (``lean_forward`` writes it
    out for the queries and keys at once); a kernel or a patch may have replaced it."""
    return all(getattr(ml, name).__module__ == ml.__name__ and not hasattr(getattr(ml, name), "__wrapped__")
               for name in ("apply_rotary_pos_emb", "rotate_half"))


def _mirrored(base: torch.nn.Module) -> tuple | None:
    """``_skipped(base)`` where ``base`` is a model ``lean_forward`` mirrors (enabled,
    transformers' own Llama classes and rotary embedding, no gradient checkpointing),
    else None."""
    if not ENABLED:
        return None
    ml = _llama_classes()
    if ml is None or type(base) is not ml.LlamaModel or getattr(base, "gradient_checkpointing", False):
        return None
    return _skipped(base, ml) if _standard_rope(ml) else None


def lean_capable(base: torch.nn.Module) -> bool:
    """Whether ``base`` is a model ``lean_forward`` mirrors, whatever the hooks and grad
    mode of the moment; ``lean_ok`` adds those. ``rheoplan.loading.speed_tag`` keys the
    latency caches on it."""
    return _mirrored(base) is not None


def lean_note(model: torch.nn.Module) -> str | None:
    """What ``rheoplan.loading`` prints for a causal LM whose decoder runs ``lean_forward``
    (None for one that does not, or that has no decoder attribute)."""
    prefix = getattr(model, "base_model_prefix", "model")
    base = getattr(model, prefix, None)
    if not isinstance(base, torch.nn.Module) or not lean_capable(base):
        return None
    return ("decoder forwards skip transformers' per-layer dispatch (rheoplan.models.lean_llama: "
            "the same operations in the same order, the same outputs)")


def lean_ok(base: torch.nn.Module) -> bool:
    """Whether ``lean_forward(base, ...)`` computes what ``base(...)`` would now (see the
    module docstring): ``lean_capable``, not training, no gradient recorded, no global
    module hook, and no hook on a module whose ``__call__`` it skips but the feature
    capture's, no ``forward`` replaced on the instance of a container it inlines. Asked on
    every forward: ~40 us for SmolLM2's 30 layers (the walk of the modules included)."""
    if base.training or torch.is_grad_enabled():
        return False
    if torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks:
        return False
    got = _mirrored(base)
    if got is None:
        return False
    layers, containers, mods = got
    # a forward replaced on the instance (a spy, accelerate's hooks) is what transformers
    # would call: the inlined one would skip it
    return (_hook_free(mods) and all(_only_capture_hooks(x) for x in layers)
            and not any("forward" in m.__dict__ for m in containers))


def lean_forward(base: torch.nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor,
                 attention_mask: torch.Tensor | None, cache, **kwargs) -> torch.Tensor:
    """``base(input_ids=..., position_ids=..., attention_mask=..., use_cache=True,
    cache=cache, **kwargs).last_hidden_state`` for a ``base`` that ``lean_ok`` accepted:
    ``input_ids`` / ``position_ids`` ``[B, q]``; returns ``[B, q, H]``. Appends to ``cache``."""
    ml = _llama_classes()
    create_causal_mask = ml.create_causal_mask  # the name LlamaModel.forward calls
    cfg = base.config
    attend = ml.ALL_ATTENTION_FUNCTIONS.get_interface(cfg._attn_implementation, ml.eager_attention_forward)
    hidden = base.embed_tokens.forward(input_ids)
    mask = create_causal_mask(config=cfg, inputs_embeds=hidden, attention_mask=attention_mask, cache=cache,
                              position_ids=position_ids)
    cos, sin = base.rotary_emb.forward(hidden, position_ids=position_ids)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # as apply_rotary_pos_emb: over the heads axis
    # rotate_half(x) * sin == roll(x, half) * (sin with its first half negated), entry for
    # entry: (-a) * b and a * (-b) are the same float. One roll per layer instead of a
    # negation, two slices and a concatenation.
    half = cos.shape[-1] // 2
    signed_sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
    shape = hidden.shape[:-1]
    # the keyword arguments transformers hands each layer's attention and cache update
    kw = {"position_ids": position_ids, "use_cache": True, **kwargs}
    if _glue_applies(base, hidden):
        return _fused_layers(base, hidden, cos, signed_sin, half, mask, cache, attend, kw)
    for layer in base.layers[:cfg.num_hidden_layers]:
        for hook in layer._forward_pre_hooks.values():
            hook(layer, (hidden,), {})  # the feature capture reads the layer's input
        attn, mlp = layer.self_attn, layer.mlp
        # LlamaDecoderLayer.forward, with LlamaAttention.forward and LlamaMLP.forward inlined;
        # modules' ``forward`` directly: lean_ok saw no hooks on them
        residual = hidden
        h = layer.input_layernorm.forward(hidden)
        heads = (*shape, -1, attn.head_dim)
        q = attn.q_proj.forward(h).view(heads).transpose(1, 2)
        k = attn.k_proj.forward(h).view(heads).transpose(1, 2)
        v = attn.v_proj.forward(h).view(heads).transpose(1, 2)
        # apply_rotary_pos_emb on the queries and keys as one tensor: the same elementwise
        # operations on every entry (the same bits), half the calls
        n_q = q.shape[1]
        qk = torch.cat((q, k), dim=1)
        qk = (qk * cos) + (qk.roll(half, dims=-1) * signed_sin)
        q, k = qk[:, :n_q], qk[:, n_q:]
        k, v = cache.update(k, v, attn.layer_idx, kwargs=kw)
        out, _ = attend(attn, q, k, v, mask, dropout=0.0, scaling=attn.scaling, **kw)
        out = attn.o_proj.forward(out.reshape(*shape, -1).contiguous())
        hidden = residual + out
        residual = hidden
        h = layer.post_attention_layernorm.forward(hidden)
        h = mlp.down_proj.forward(mlp.act_fn(mlp.gate_proj.forward(h)) * mlp.up_proj.forward(h))
        hidden = residual + h
    return base.norm.forward(hidden)


# -- fused glue -------------------------------------------------------------------------------

#: decoder models whose glue runs fused (``fuse_glue``)
_FUSED: weakref.WeakSet = weakref.WeakSet()
#: most tokens (rows x new tokens) of a forward whose glue runs fused (the kernels' own bound)
GLUE_MAX_ROWS = glue.MAX_ROWS


def fuse_glue(base: torch.nn.Module, on: bool = True) -> None:
    """Run (``on``) or stop running the norms, residual sums and rotary embedding of
    ``base``'s lean forwards of at most ``GLUE_MAX_ROWS`` tokens through
    ``rheoplan.kernels.decoder_glue`` (one numba call each, bfloat16 on the CPU): the same
    operations, the same bits (the kernels' docstring). The loaders turn it on where it
    measured faster (``rheoplan.loading.fuse_glue_if_it_pays``)."""
    if on:
        _FUSED.add(base)
    else:
        _FUSED.discard(base)


def glue_fused(base: torch.nn.Module) -> bool:
    """Whether ``fuse_glue`` is on for ``base``."""
    return base in _FUSED


def _glue_applies(base: torch.nn.Module, hidden: torch.Tensor) -> bool:
    """Whether this forward runs ``_fused_layers``: glue fused for ``base``, bfloat16 on the
    CPU, at most ``GLUE_MAX_ROWS`` tokens, and every norm transformers' own class (a
    patched norm runs its own forward, in the loop above)."""
    if base not in _FUSED or hidden.dtype != torch.bfloat16 or not hidden.is_cpu:
        return False
    if hidden.numel() > GLUE_MAX_ROWS * hidden.shape[-1]:
        return False
    norm = _llama_classes().LlamaRMSNorm
    return type(base.norm) is norm and all(
        type(x.input_layernorm) is norm and type(x.post_attention_layernorm) is norm
        for x in base.layers[:base.config.num_hidden_layers])


def _fused_layers(base, hidden, cos, signed_sin, half, mask, cache, attend, kw) -> torch.Tensor:
    """``lean_forward``'s layers with the glue fused: each residual sum and the norm after
    it in one call, the rotary embedding of the queries and of the keys in one call each
    (over the projections' rows as they come, before the heads are split off)."""
    shape = hidden.shape[:-1]
    # the angles per token, as the kernel reads them: [*shape, head_dim], contiguous
    cos = cos.squeeze(1).expand(*shape, -1).contiguous()
    signed_sin = signed_sin.squeeze(1).expand(*shape, -1).contiguous()
    delta = None  # the last MLP's output, summed into the residual with the next norm
    layers = base.layers[:base.config.num_hidden_layers]
    growing = growing_layers(cache, len(layers)) if QKV_APPEND else None
    rows = shape.numel()
    for layer in layers:
        # children through ``_modules`` / ``_parameters``: ``nn.Module.__getattr__`` costs ~1 us
        # a name, ~10 names a layer
        lm = layer._modules
        ln = lm["input_layernorm"]
        if delta is None:
            h = glue.rms_norm(hidden, ln._parameters["weight"], ln.variance_epsilon)
        else:
            hidden, h = glue.add_rms_norm(hidden, delta, ln._parameters["weight"], ln.variance_epsilon)
        for hook in layer._forward_pre_hooks.values():
            hook(layer, (hidden,), {})  # the feature capture reads the layer's input
        attn, mlp = lm["self_attn"], lm["mlp"]
        am, mm = attn._modules, mlp._modules
        d = attn.head_dim
        arrays = _kernel_weights(attn, mlp, rows) if DIRECT_PRODUCTS else None
        qkv = None
        if growing is not None:
            if arrays is not None:
                product = functools.partial(_product_into, w=arrays[0], name="qkv")
            else:
                product = shared_product(am["q_proj"], am["k_proj"], am["v_proj"])
                product = None if product is None else product.forward
            if product is not None:
                qkv = _rope_into_cache(attn, h, product, cos, signed_sin, growing[attn.layer_idx])
        if qkv is not None:
            q, k, v = qkv
        else:
            q = glue.rope(am["q_proj"].forward(h), cos, signed_sin, d).view(*shape, -1, d).transpose(1, 2)
            k = glue.rope(am["k_proj"].forward(h), cos, signed_sin, d).view(*shape, -1, d).transpose(1, 2)
            v = am["v_proj"].forward(h).view(*shape, -1, d).transpose(1, 2)
            k, v = cache.update(k, v, attn.layer_idx, kwargs=kw)
        out, _ = attend(attn, q, k, v, mask, dropout=0.0, scaling=attn.scaling, **kw)
        out = out.reshape(*shape, -1).contiguous()
        out = am["o_proj"].forward(out) if arrays is None else _product_into(out, arrays[1], "o")
        pn = lm["post_attention_layernorm"]
        hidden, h = glue.add_rms_norm(hidden, out, pn._parameters["weight"], pn.variance_epsilon)
        gate_proj, act_fn = mm["gate_proj"], mm["act_fn"]
        if arrays is None:
            delta = mm["down_proj"].forward(act_fn(gate_proj.forward(h)) * mm["up_proj"].forward(h))
        else:
            gate_up = _product_into(h, arrays[2], "gate_up")
            width = gate_proj.out_features
            act = _scratch("act", (*shape, width))
            # the MLP's own operations on the same strided columns as the parts' products
            torch.mul(act_fn(gate_up[..., :width]), gate_up[..., width:], out=act)
            delta = _product_into(act, arrays[3], "down")
    norm = base.norm
    if delta is None:
        return glue.rms_norm(hidden, norm.weight, norm.variance_epsilon)
    return glue.add_rms_norm(hidden, delta, norm.weight, norm.variance_epsilon)[1]


def _rope_into_cache(attn, h: torch.Tensor, product, cos: torch.Tensor, signed_sin: torch.Tensor,
                     layer) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``(q, k, v)`` as the attention takes them, with the keys and values appended to
    ``layer``'s buffers, in one kernel call (``glue.rope_qkv_append``) on the layer's q | k | v
    product run once (``product(h)``: the projections' ``shared_product``, or its kernel
    through ``_product_into``): where ``layer`` (a ``GrowingLayer``) has room for the new
    columns (``free_column``); else None.

    Why: separately the three projections' columns, two rotary calls, three view-and-
    transposes and ``cache.update``'s two narrowed copies and two narrows are ~20 small
    calls a layer, a few microseconds each, 600 a forward. The same operations on the same
    entries: the queries, keys and values are the bits of the separate path, the queries
    in the same strided view."""
    if layer is None:
        return None
    shape = h.shape[:-1]
    n = layer.free_column(shape[0], shape[1])
    if n is None:
        return None
    d = attn.head_dim
    key_buf, value_buf = layer.buffers
    q = glue.rope_qkv_append(product(h), attn._modules["q_proj"].out_features // d, cos, signed_sin, d,
                             key_buf, value_buf, n)
    k, v = layer.written(n, shape[1])
    return q.view(*shape, -1, d).transpose(1, 2), k, v


# -- products straight through the kernel ------------------------------------------------------

#: set to False to run the fused glue's products through the modules' ``forward`` instead of
#: ``_product_into`` (A/B measurements)
DIRECT_PRODUCTS = True

#: per Python thread: ``{(name, shape): (tensor, its bits as a [rows, width] uint16 array)}``,
#: the outputs ``_product_into`` and the MLP write and the next call overwrites; one entry
#: per name and shape met (fused forwards: at most ``GLUE_MAX_ROWS`` tokens, ~100 KB each)
_SCRATCH = threading.local()


def _scratch_pair(name: str, shape: tuple) -> tuple[torch.Tensor, np.ndarray]:
    bufs = getattr(_SCRATCH, "bufs", None)
    if bufs is None:
        bufs = _SCRATCH.bufs = {}
    got = bufs.get((name, shape))
    if got is None:
        t = torch.empty(shape, dtype=torch.bfloat16)
        got = bufs[(name, shape)] = (t, t.view(torch.int16).numpy().view(np.uint16).reshape(-1, shape[-1]))
    return got


def _scratch(name: str, shape: tuple) -> torch.Tensor:
    """A bfloat16 tensor of ``shape`` kept for this thread under ``name``: overwritten by the
    next call with the same name and shape, so only for values used up before then (never
    one a forward returns, a hook may keep, or the cache holds)."""
    return _scratch_pair(name, shape)[0]


#: per attention module: ``(pack_count(), its layer's seven linears, fewest rows, most rows,
#: the four weight arrays)`` as ``_kernel_weights`` last read them
_KERNEL_WEIGHTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _kernel_weights(attn, mlp, rows: int) -> tuple | None:
    """The weight arrays of a layer's q | k | v, o, gate | up and down products where every
    one of them runs the few-row kernel's bfloat16 product for ``rows`` rows
    (``shared_product``, ``bfloat16_kernel_span``) and no gradient is recorded, else None.

    Why kept per layer: read afresh (two ``shared_product`` and four span checks) this
    took 14 us a layer inside forwards on the AVX2-only AMD EPYC, 0.42 ms a forward
    (docs/results.md, "Fortieth round"). What was read stays right while the layer holds
    the same seven linears and nothing was repacked since (``pack_count``): a repack may
    replace an array, and only a repack or another module does (the few-row spans are
    fixed when a ``PackedLinear`` is made)."""
    if torch.is_grad_enabled():
        return None
    # the children through ``_modules``: ``nn.Module.__getattr__`` costs ~1 us a name
    am, mm = attn._modules, mlp._modules
    mods = (am["q_proj"], am["k_proj"], am["v_proj"], am["o_proj"], mm["gate_proj"], mm["up_proj"], mm["down_proj"])
    packs = pack_count()
    got = _KERNEL_WEIGHTS.get(attn)
    if got is None or got[0] != packs or got[1] != mods:  # a tuple of modules compares them by identity
        got = _KERNEL_WEIGHTS[attn] = (packs, mods, *_layer_spans(mods))
    arrays = got[4]
    if arrays is None or not got[2] <= rows <= got[3]:
        return None
    return arrays


def _layer_spans(mods: tuple) -> tuple[int, int, tuple | None]:
    """``(fewest rows, most rows, arrays)`` for ``_kernel_weights`` from a layer's q, k, v,
    o, gate, up and down linears: the rows for which all four products run the kernel."""
    q, k, v, o, gate, up, down = mods
    qkv = shared_product(q, k, v)
    gate_up = shared_product(gate, up)
    if qkv is None or gate_up is None:
        return 0, -1, None
    spans = [bfloat16_kernel_span(m) for m in (qkv, o, gate_up, down)]
    if any(span is None for span in spans):
        return 0, -1, None
    return (max(span[1] for span in spans), min(span[2] for span in spans),
            tuple(span[0] for span in spans))


def _product_into(x: torch.Tensor, w: np.ndarray, name: str) -> torch.Tensor:
    """``x [..., K]`` (bfloat16, contiguous) times the kernel weight ``w [N, K]``
    (``_kernel_weights``), into this thread's scratch tensor ``name`` of shape ``[..., N]``:
    the kernel call of the module's ``forward`` (``bfloat16_rows_into``), the same bits,
    without ``PackedLinear.forward``'s checks, conversions and allocation (16 of a one-row
    call's 20 us in a tight loop; four products a layer)."""
    if not x.is_contiguous():
        x = x.contiguous()
    out, out_bits = _scratch_pair(name, (*x.shape[:-1], w.shape[0]))
    bfloat16_rows_into(x.view(torch.int16).numpy().view(np.uint16).reshape(-1, x.shape[-1]), w, out_bits)
    return out
