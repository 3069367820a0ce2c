"""The lean Llama forward computes what transformers' forward computes, bit for bit, and
steps aside whenever it might not (foreign hooks, gradients, other classes, a patched
rotary embedding)."""

from __future__ import annotations

import functools

import pytest
import torch

import rheoplan.models.lean_llama as lean
from rheoplan.models._hf_common import new_cache, prefix_and_block_mask, run_base, run_base_rows
from rheoplan.models.packed_linear import pack_linears, packing_available


def _llama(dtype: torch.dtype, packed: bool | str, seed: int = 0, few_rows: int = 1, **config):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=97, max_position_embeddings=256, **config)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # norms start at ones: tell them apart
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model = model.to(dtype)
    if packed == "kernel":  # fused products through the few-row kernel from ``few_rows`` rows, on any CPU
        pack_linears(model, onednn=False, few_rows=few_rows, fuse=True)
    elif packed == "fused":  # fused products on any CPU: oneDNN's where it packs, else the few-row kernel's
        onednn = packing_available(dtype, torch.device("cpu"))
        pack_linears(model, onednn=onednn, few_rows=0 if onednn else 1, fuse=True)
    elif packed:
        if not packing_available(dtype, torch.device("cpu")):
            pytest.skip(f"no oneDNN packing for {dtype} here")
        pack_linears(model, fuse=True)  # the packed, fused projections the loaders use
    return model


def _tree_mask(parents: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(ancestor-or-self mask [n, n], depth [n]) of a tree given by its parents, each
    parent listed before its children."""
    anc = torch.eye(len(parents), dtype=torch.bool)
    for j, p in enumerate(parents[1:], start=1):
        anc[j] |= anc[p]
    return anc, anc.sum(1) - 1


def _layers(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(x.keys.clone(), x.values.clone()) for x in cache.layers]


def _both(monkeypatch, fn):
    """``fn()`` through the lean forward and through transformers' (fresh state each)."""
    out = {}
    for enabled in (True, False):
        monkeypatch.setattr(lean, "ENABLED", enabled)
        out[enabled] = fn()
    return out[True], out[False]


def _one_row(model, parents, prefix_len=11):
    """Hidden states of a prefill of ``prefix_len`` tokens, then of one tree verify (the
    cache's tensors after it too), as ``HFTarget`` runs them."""
    base = model.model
    g = torch.Generator().manual_seed(prefix_len)
    ids = torch.randint(0, 97, (prefix_len + len(parents),), generator=g)
    cache = new_cache(model)
    pre = torch.arange(prefix_len)
    with torch.no_grad():
        h0 = run_base(base, cache, ids[:prefix_len], pre, torch.ones(prefix_len, prefix_len, dtype=torch.bool).tril())
        anc, depth = _tree_mask(parents)
        n = len(parents)
        if n == 1:
            h1 = run_base(base, cache, ids[prefix_len:], depth + prefix_len, None, all_allowed=True)
        else:
            h1 = run_base(base, cache, ids[prefix_len:], depth + prefix_len, prefix_and_block_mask(prefix_len, anc),
                          all_allowed=False)
    return h0, h1, _layers(cache)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("parents", [[-1], [-1, 0], [-1, 0, 0, 1, 1, 2, 3]])
def test_the_lean_forward_gives_transformers_outputs_and_cache_bit_for_bit(monkeypatch, dtype, packed, parents):
    model = _llama(dtype, packed)
    assert lean.lean_capable(model.model)
    with torch.no_grad():
        assert lean.lean_ok(model.model)
    (a0, a1, ca), (b0, b1, cb) = _both(monkeypatch, lambda: _one_row(model, parents))
    assert torch.equal(a0, b0) and torch.equal(a1, b1)
    for (ka, va), (kb, vb) in zip(ca, cb):
        assert torch.equal(ka, kb) and torch.equal(va, vb)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_lean_forward_of_several_rows_is_transformers_forward_bit_for_bit(monkeypatch, dtype):
    model = _llama(dtype, packed=True)
    base = model.model
    B, P, q = 3, 9, 4
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 97, (B, P + q), generator=g)
    anc, depth = _tree_mask([-1, 0, 0, 1])
    # rows of different prompt lengths, left-padded: row b hides its first b columns
    allowed = torch.zeros(B, q, P + q, dtype=torch.bool)
    allowed[:, :, P:] = anc
    for b in range(B):
        allowed[b, :, b:P] = True

    def run():
        cache = new_cache(model)
        causal = torch.ones(B, P, P, dtype=torch.bool).tril()
        for b in range(B):
            causal[b, :, :b] = False
            causal[b, torch.arange(b), torch.arange(b)] = True  # a padded query sees itself: never all masked
        with torch.no_grad():
            h0 = run_base_rows(base, cache, ids[:, :P], torch.arange(P).expand(B, P), causal)
            h1 = run_base_rows(base, cache, ids[:, P:], (P + depth).expand(B, q), allowed)
        return h0, h1, _layers(cache)

    (a0, a1, ca), (b0, b1, cb) = _both(monkeypatch, run)
    assert torch.equal(a0, b0) and torch.equal(a1, b1)
    for (ka, va), (kb, vb) in zip(ca, cb):
        assert torch.equal(ka, kb) and torch.equal(va, vb)


def test_the_feature_capture_reads_the_same_layer_inputs_through_the_lean_forward(monkeypatch):
    from rheoplan.models.hf_target import HFTarget

    model = _llama(torch.float32, packed=False)

    def run():
        tgt = HFTarget(model, capture_layers=[0, 2])
        try:
            assert lean.lean_ok(model.model) is False  # grad mode: the check below runs under no_grad
            with torch.no_grad():
                assert lean.lean_ok(model.model) == lean.ENABLED
            served = tgt.start_and_root([5, 7, 11, 13, 17, 19])
            return tgt.prompt_features().clone(), served.features(0).clone()
        finally:
            tgt.close()

    (fa, ra), (fb, rb) = _both(monkeypatch, run)
    assert fa.shape == (6, 2 * 64)
    assert torch.equal(fa, fb) and torch.equal(ra, rb)


def test_any_other_hook_sends_the_forward_back_to_transformers(monkeypatch):
    model = _llama(torch.float32, packed=False)
    base = model.model
    calls = []
    with torch.no_grad():
        assert lean.lean_ok(base)
        for mod in (base.layers[1].mlp, base.layers[0].self_attn.q_proj, base.layers[2], base.norm):
            h = mod.register_forward_hook(lambda m, a, o: calls.append(m))
            assert not lean.lean_ok(base)
            _one_row(model, [-1, 0])
            assert calls and calls[-1] is mod  # the hook ran: transformers' forward did
            h.remove()
            assert lean.lean_ok(base)
        h = base.layers[1].register_forward_pre_hook(lambda m, a: None)  # not marked as a capture
        assert not lean.lean_ok(base)
        h.remove()
        h = torch.nn.modules.module.register_module_forward_hook(lambda m, a, o: None)
        try:
            assert not lean.lean_ok(base)
        finally:
            h.remove()
        assert lean.lean_ok(base)
        spied = []
        real = base.layers[2].mlp.forward
        base.layers[2].mlp.forward = lambda x: spied.append(1) or real(x)  # a spy, as accelerate's hooks
        assert not lean.lean_ok(base)
        _one_row(model, [-1])
        assert spied
        del base.layers[2].mlp.forward
        assert lean.lean_ok(base)
        model.train()
        assert not lean.lean_ok(base)
        model.eval()
    assert not lean.lean_ok(base)  # gradients recorded
    monkeypatch.setattr(lean, "ENABLED", False)
    with torch.no_grad():
        assert not lean.lean_ok(base)


def test_only_transformers_own_llama_classes_and_rotary_embedding_are_lean(monkeypatch):
    from transformers import GPT2Config, GPT2Model
    from transformers.models.llama import modeling_llama as ml

    assert not lean.lean_capable(GPT2Model(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50)))

    class MyLayer(ml.LlamaDecoderLayer):
        pass

    model = _llama(torch.float32, packed=False)
    model.model.layers[1] = MyLayer(model.config, 1)
    assert not lean.lean_capable(model.model)

    model = _llama(torch.float32, packed=False)
    assert lean.lean_capable(model.model)
    real = ml.apply_rotary_pos_emb

    @functools.wraps(real)
    def patched(*a, **k):  # what a kernel library's patch looks like
        return real(*a, **k)

    monkeypatch.setattr(ml, "apply_rotary_pos_emb", patched)
    assert not lean.lean_capable(model.model)


def test_the_speed_tag_keys_latencies_on_the_lean_forward(monkeypatch):
    from rheoplan.loading import speed_tag

    model = _llama(torch.float32, packed=False)
    assert speed_tag(model).endswith(" lean")
    assert lean.lean_note(model) is not None
    monkeypatch.setattr(lean, "ENABLED", False)
    assert "lean" not in speed_tag(model) and lean.lean_note(model) is None


def test_modules_swapped_after_a_first_forward_are_the_ones_checked(monkeypatch):
    """The loader runs forwards (the dtype probe) before it packs the linear weights: the
    hook checks must look at the modules the model holds now, not at those of an earlier
    forward."""
    if not packing_available(torch.float32, torch.device("cpu")):
        pytest.skip("no oneDNN packing for float32 here")
    model = _llama(torch.float32, packed=False)
    base = model.model
    _one_row(model, [-1, 0])  # a first forward over the plain nn.Linear projections
    pack_linears(model, fuse=True)
    with torch.no_grad():
        assert lean.lean_ok(base)
        proj = base.layers[1].mlp.down_proj  # a PackedLinear the first forward never saw
        calls = []
        h = proj.register_forward_hook(lambda m, a, o: calls.append(m))
        assert not lean.lean_ok(base)
        _one_row(model, [-1, 0])
        assert calls and calls[-1] is proj
        h.remove()
        from transformers.models.llama import modeling_llama as ml

        class MyMLP(ml.LlamaMLP):
            pass

        mlp = MyMLP(model.config)
        base.layers[0].mlp = mlp  # a class lean_forward does not mirror, swapped in later
        assert not lean.lean_ok(base) and not lean.lean_capable(base)


def _fused_step_both(monkeypatch, model, parents, count) -> tuple:
    """``(count's record, lean result, transformers' result)`` of ``_one_row`` with the glue
    fused (a prefill longer than ``GLUE_MAX_ROWS``, then the step), ``count(monkeypatch)``
    installed first; skips where the norm kernels do not sum as torch does."""
    from rheoplan.kernels.decoder_glue import cpu

    if not cpu.norm_applies():
        pytest.skip("torch's summation order not found on this CPU")
    lean.fuse_glue(model.model)
    try:
        seen = count(monkeypatch)
        ours, theirs = _both(monkeypatch, lambda: _one_row(model, parents, prefix_len=lean.GLUE_MAX_ROWS + 1))
    finally:
        lean.fuse_glue(model.model, False)
    return seen, ours, theirs


def _assert_same_row(ours, theirs) -> None:
    """Two ``_one_row`` results are the same bits: hidden states and every cache tensor."""
    (a0, a1, ca), (b0, b1, cb) = ours, theirs
    assert torch.equal(a0, b0) and torch.equal(a1, b1)
    for (ka, va), (kb, vb) in zip(ca, cb):
        assert torch.equal(ka, kb) and torch.equal(va, vb)


def _count_glue_calls(monkeypatch) -> list[str]:
    calls = []
    for name in ("rms_norm", "add_rms_norm", "rope", "rope_qkv_append"):
        real = getattr(lean.glue, name)
        monkeypatch.setattr(lean.glue, name, lambda *a, real=real, name=name: calls.append(name) or real(*a))
    return calls


@pytest.mark.parametrize("parents", [[-1], [-1, 0, 0, 1, 1, 2, 3]])
def test_the_fused_glue_gives_transformers_outputs_and_cache_bit_for_bit(monkeypatch, parents):
    """bfloat16, the loaders' fused products: with the glue fused, a prefill (more than
    ``GLUE_MAX_ROWS`` tokens: torch's operators) then a one-token step or a tree verify (the
    kernels; the queries, keys and values of each layer in one call that appends to the
    cache), against transformers' forward."""
    model = _llama(torch.bfloat16, packed="fused")
    calls, ours, theirs = _fused_step_both(monkeypatch, model, parents, _count_glue_calls)
    # the step ran fused (2 norms and one rotary-and-append call a layer, the final norm),
    # the prefill did not
    layers = model.config.num_hidden_layers
    assert calls.count("rope_qkv_append") == layers and len(calls) == 3 * layers + 1
    _assert_same_row(ours, theirs)


def test_the_fused_glue_of_several_rows_with_features_is_transformers_forward_bit_for_bit(monkeypatch):
    """Rows of a batch (4 x 3 tokens) and the feature capture's layer inputs, fused and not."""
    from rheoplan.kernels.decoder_glue import cpu

    if not cpu.norm_applies():
        pytest.skip("torch's summation order not found on this CPU")
    model = _llama(torch.bfloat16, packed="fused")
    base = model.model
    B, P, q = 4, 5, 3
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 97, (B, P + q), generator=g)
    seen = []

    @lean.capture_hook
    def capture(layer, args, kwargs):
        seen.append(args[0].clone())

    hooks = [base.layers[i].register_forward_pre_hook(capture, with_kwargs=True) for i in (0, 2)]

    def run():
        seen.clear()
        cache = new_cache(model)
        with torch.no_grad():
            h0 = run_base_rows(base, cache, ids[:, :P], torch.arange(P).expand(B, P),
                               torch.ones(B, P, P, dtype=torch.bool).tril())
            allowed = torch.ones(B, q, P + q, dtype=torch.bool)
            allowed[:, :, P:] = torch.ones(q, q, dtype=torch.bool).tril()
            h1 = run_base_rows(base, cache, ids[:, P:], (P + torch.arange(q)).expand(B, q), allowed)
        return h0, h1, _layers(cache), list(seen)

    lean.fuse_glue(base)
    try:
        calls = _count_glue_calls(monkeypatch)
        (a0, a1, ca, fa), (b0, b1, cb, fb) = _both(monkeypatch, run)
    finally:
        lean.fuse_glue(base, False)
        for h in hooks:
            h.remove()
    assert calls.count("rope_qkv_append") == model.config.num_hidden_layers  # the 12-token verify ran fused
    assert torch.equal(a0, b0) and torch.equal(a1, b1)
    assert len(fa) == len(fb) == 4 and all(torch.equal(x, y) for x, y in zip(fa, fb))
    for (ka, va), (kb, vb) in zip(ca, cb):
        assert torch.equal(ka, kb) and torch.equal(va, vb)


def _count_products(monkeypatch) -> list[str]:
    """The names of the products ``_fused_layers`` runs straight through the kernel."""
    names = []
    real = lean._product_into
    monkeypatch.setattr(lean, "_product_into", lambda x, w, name: names.append(name) or real(x, w, name))
    return names


@pytest.mark.parametrize("parents", [[-1], [-1, 0, 0, 1, 1, 2, 3]])
def test_products_straight_through_the_kernel_give_transformers_outputs_bit_for_bit(monkeypatch, parents):
    """Few-row kernel products (the AVX2-only hosts' loaders): with the glue fused, each
    layer's four products run through ``_product_into`` into reused outputs, and a
    one-token step or a tree verify still gives transformers' hidden states and cache."""
    model = _llama(torch.bfloat16, packed="kernel")
    names, ours, theirs = _fused_step_both(monkeypatch, model, parents, _count_products)
    assert names == ["qkv", "o", "gate_up", "down"] * model.config.num_hidden_layers  # the step's, not the prefill's
    _assert_same_row(ours, theirs)


def test_products_into_reused_outputs_leave_earlier_results_and_features_alone(monkeypatch):
    """The outputs ``_product_into`` reuses never reach the caller: the hidden states of
    four chain steps of a 2-row batch, kept across the steps, and the layer inputs the
    feature capture kept are transformers' bits at the end."""
    from rheoplan.kernels.decoder_glue import cpu

    if not cpu.norm_applies():
        pytest.skip("torch's summation order not found on this CPU")
    model = _llama(torch.bfloat16, packed="kernel")
    base = model.model
    B, P, q = 2, 5, 2
    ids = torch.randint(0, 97, (B, P + 4 * q), generator=torch.Generator().manual_seed(8))
    seen = []

    @lean.capture_hook
    def capture(layer, args, kwargs):
        seen.append(args[0])  # kept as handed over, not copied

    hook = base.layers[1].register_forward_pre_hook(capture, with_kwargs=True)

    def run():
        seen.clear()
        cache = new_cache(model)
        with torch.no_grad():
            outs = [run_base_rows(base, cache, ids[:, :P], torch.arange(P).expand(B, P),
                                  torch.ones(B, P, P, dtype=torch.bool).tril())]
            for n in range(P, P + 4 * q, q):
                allowed = torch.ones(B, q, n + q, dtype=torch.bool)
                allowed[:, :, n:] = torch.ones(q, q, dtype=torch.bool).tril()
                outs.append(run_base_rows(base, cache, ids[:, n:n + q], (n + torch.arange(q)).expand(B, q), allowed))
        return outs, list(seen)

    lean.fuse_glue(base)
    try:
        names = _count_products(monkeypatch)
        (a, fa), (b, fb) = _both(monkeypatch, run)
    finally:
        lean.fuse_glue(base, False)
        hook.remove()
    # the prefill of 10 tokens is fused too (its cache layers have no buffer yet: q / k / v apart)
    layers = model.config.num_hidden_layers
    assert names == ["o", "gate_up", "down"] * layers + ["qkv", "o", "gate_up", "down"] * layers * 4
    assert len(a) == len(b) == 5 and all(torch.equal(x, y) for x, y in zip(a, b))
    assert len(fa) == len(fb) == 5 and all(torch.equal(x, y) for x, y in zip(fa, fb))


@pytest.mark.parametrize("why", ["a bias", "one row below the kernel's span", "oneDNN's products"])
def test_products_step_aside_where_the_module_would_not_run_the_kernel_alone(monkeypatch, why):
    """Where a layer's module would compute otherwise (a bias added after the sums, a row
    count outside the kernel's span, a oneDNN product) its products go through the
    modules, with transformers' bits."""
    if why == "a bias":
        model = _llama(torch.bfloat16, packed="kernel", attention_bias=True, mlp_bias=True)
    elif why == "one row below the kernel's span":
        model = _llama(torch.bfloat16, packed="kernel", few_rows=2)
    else:
        if not packing_available(torch.bfloat16, torch.device("cpu")):
            pytest.skip("no oneDNN packing for bfloat16 here")
        model = _llama(torch.bfloat16, packed=True)
    names, ours, theirs = _fused_step_both(monkeypatch, model, [-1], _count_products)
    assert names == []
    _assert_same_row(ours, theirs)


def test_the_kept_kernel_weights_follow_a_repack_and_a_swapped_module(monkeypatch):
    """``_kernel_weights`` keeps each layer's weight arrays from one forward to the next.
    After a projection's weight changed and was repacked, and after one was swapped for a
    plain ``nn.Linear`` of other weights, a verify still gives transformers' bits (arrays
    kept from before would give the old weights' products)."""
    model = _llama(torch.bfloat16, packed="kernel")
    parents = [-1, 0, 0, 1]
    layers = model.config.num_hidden_layers
    every = ["qkv", "o", "gate_up", "down"] * layers
    names, ours, theirs = _fused_step_both(monkeypatch, model, parents, _count_products)
    assert names == every  # the arrays are kept from here on
    _assert_same_row(ours, theirs)
    layer = model.model.layers[1]
    with torch.no_grad():
        layer.self_attn.q_proj.weight.mul_(-1.5)  # its shared product holds a copy: repacked
        layer.self_attn.q_proj.repack()
    names, ours, theirs = _fused_step_both(monkeypatch, model, parents, _count_products)
    assert names == every
    _assert_same_row(ours, theirs)
    old = layer.mlp.down_proj
    plain = torch.nn.Linear(old.in_features, old.out_features, bias=False, dtype=torch.bfloat16)
    with torch.no_grad():
        plain.weight.copy_(old.weight.flip(0))
    layer.mlp.down_proj = plain  # nothing repacked: only the module differs
    names, ours, theirs = _fused_step_both(monkeypatch, model, parents, _count_products)
    assert names == every[:4] + every[8:]  # layer 1's four products through its modules
    _assert_same_row(ours, theirs)


def _chain_steps(model, cache, steps: int, q: int, prefix_len: int) -> list[torch.Tensor]:
    """Hidden states of a ``prefix_len``-token prefill, then ``steps`` forwards of ``q`` chain
    tokens each into ``cache`` (nothing cropped: the cache fills)."""
    base = model.model
    g = torch.Generator().manual_seed(steps)
    ids = torch.randint(0, 97, (prefix_len + steps * q,), generator=g)
    outs = []
    with torch.no_grad():
        outs.append(run_base(base, cache, ids[:prefix_len], torch.arange(prefix_len),
                             torch.ones(prefix_len, prefix_len, dtype=torch.bool).tril()))
        for s in range(steps):
            n = prefix_len + s * q
            allowed = torch.ones(q, n + q, dtype=torch.bool)
            allowed[:, n:] = torch.ones(q, q, dtype=torch.bool).tril()
            outs.append(run_base(base, cache, ids[n:n + q], torch.arange(n, n + q), allowed, all_allowed=False))
    return outs


def test_the_rotary_and_cache_append_call_steps_aside_where_the_cache_must_append(monkeypatch):
    """A cache that fills: steps with room write the new columns in the one call, the step
    without room goes through ``cache.update`` (a larger buffer), then the call goes on;
    every step transformers' bits."""
    import rheoplan.models.growing_cache as gc
    from rheoplan.kernels.decoder_glue import cpu

    if not cpu.norm_applies():
        pytest.skip("torch's summation order not found on this CPU")
    monkeypatch.setattr(gc, "MIN_SPARE", 1)  # buffers of the prefill + half as much again: full soon
    model = _llama(torch.bfloat16, packed="fused")
    lean.fuse_glue(model.model)
    try:
        calls = _count_glue_calls(monkeypatch)
        (a, ca), (b, cb) = _both(monkeypatch, lambda: (lambda c: (_chain_steps(model, c, 4, 3, 17), _layers(c)))(
            new_cache(model)))
    finally:
        lean.fuse_glue(model.model, False)
    # 17 columns + 8 spare: the first two steps fit, the third grows the buffers, the fourth fits
    layers = model.config.num_hidden_layers
    assert calls.count("rope_qkv_append") == 3 * layers and calls.count("rope") == 2 * layers
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    for (ka, va), (kb, vb) in zip(ca, cb):
        assert torch.equal(ka, kb) and torch.equal(va, vb)


@pytest.mark.parametrize("why", ["separate projections", "transformers' own cache layers"])
def test_the_rotary_and_cache_append_call_steps_aside_for_other_layers_and_caches(monkeypatch, why):
    from transformers import DynamicCache

    from rheoplan.kernels.decoder_glue import cpu

    if not cpu.norm_applies():
        pytest.skip("torch's summation order not found on this CPU")
    model = _llama(torch.bfloat16, packed=False if why == "separate projections" else "fused")
    make = (lambda: DynamicCache(config=model.config)) if why.startswith("transformers") else (lambda: new_cache(model))
    lean.fuse_glue(model.model)
    try:
        calls = _count_glue_calls(monkeypatch)
        (a, ca), (b, cb) = _both(monkeypatch, lambda: (lambda c: (_chain_steps(model, c, 2, 3, 17), _layers(c)))(make()))
    finally:
        lean.fuse_glue(model.model, False)
    assert "rope_qkv_append" not in calls and calls.count("rope") == 2 * 2 * model.config.num_hidden_layers
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    for (ka, va), (kb, vb) in zip(ca, cb):
        assert torch.equal(ka, kb) and torch.equal(va, vb)


def test_the_fused_glue_steps_aside_for_float32_and_patched_norms(monkeypatch):
    from transformers.models.llama import modeling_llama as ml

    model = _llama(torch.float32, packed=False)
    lean.fuse_glue(model.model)
    try:
        calls = _count_glue_calls(monkeypatch)
        _one_row(model, [-1, 0])
        assert calls == []  # float32: torch's operators, transformers' bits
        assert lean.glue_fused(model.model)
        model = model.to(torch.bfloat16)

        class MyNorm(ml.LlamaRMSNorm):
            pass

        model.model.layers[1].post_attention_layernorm.__class__ = MyNorm
        _one_row(model, [-1, 0])
        assert calls == []  # a norm that is not transformers' own runs its own forward
    finally:
        lean.fuse_glue(model.model, False)
    assert not lean.glue_fused(model.model)


def test_the_speed_tag_keys_latencies_on_the_fused_glue():
    from rheoplan.loading import speed_tag

    model = _llama(torch.bfloat16, packed=False)
    assert speed_tag(model).endswith(" lean")
    lean.fuse_glue(model.model)
    try:
        assert speed_tag(model).endswith(" lean glue")
    finally:
        lean.fuse_glue(model.model, False)
