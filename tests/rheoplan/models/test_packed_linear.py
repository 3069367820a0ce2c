"""Packed linear weights: the same outputs up to rounding (oneDNN's packed product against the
eager one: bit for bit on some CPUs in bfloat16, a last-bit difference on others), a model that
still behaves as one."""

from __future__ import annotations

import pytest
import torch

from rheoplan.models.packed_linear import (PackedLinear, pack_if_it_pays, pack_linears, packing_available,
                                           packing_decision, packing_pays, unpack_linears)


def assert_same_up_to_rounding(got: torch.Tensor, want: torch.Tensor, what=None) -> None:
    """Equal, or apart by no more than the result's own rounding: in bfloat16 one unit in the
    last place (2**-7 relative; 64- and 150-row products differ so on the Intel Xeon and the
    CI machine of 2026-12-03, while the AMD EPYC's were bit-identical), with a small absolute floor for outputs near zero,
    whose float32 sums differ in order before rounding. A wrong weight, layout or bias misses
    by orders of magnitude more."""
    assert got.dtype == want.dtype and got.shape == want.shape, what
    rtol = 2 ** -7 if want.dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got, want, rtol=rtol, atol=1e-4 if want.dtype == torch.bfloat16 else 1e-5,
                               msg=lambda m: f"{what}: {m}")


needs_packing = pytest.mark.skipif(not packing_available(torch.bfloat16, "cpu"),
                                   reason="this torch build cannot pack bfloat16 linear weights")


@needs_packing
@pytest.mark.parametrize("shape", [(576, 576), (192, 576), (1536, 576), (576, 1536), (8192, 576), (96, 1728)])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_outputs_equal_the_plain_product_up_to_rounding(shape, bias):
    torch.manual_seed(0)
    lin = torch.nn.Linear(shape[1], shape[0], bias=bias).to(torch.bfloat16)
    packed = PackedLinear(lin)
    with torch.no_grad():
        for rows in (1, 2, 3, 9, 16, 17, 64, 150):
            x = torch.randn(rows, shape[1], dtype=torch.bfloat16)
            assert_same_up_to_rounding(packed(x), lin(x), f"{rows} rows")
        x3 = torch.randn(2, 5, shape[1], dtype=torch.bfloat16)  # [batch, tokens, features]
        assert_same_up_to_rounding(packed(x3), lin(x3), "[2, 5] rows")


def _tiny_llama(dtype=torch.bfloat16):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=101, tie_word_embeddings=True)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval().to(dtype)


@needs_packing
def test_a_packed_model_gives_the_same_logits_and_keeps_its_parameters():
    model = _tiny_llama()
    ids = torch.tensor([[1, 5, 9, 33, 7, 2]])
    with torch.no_grad():
        want = model(ids).logits
    names = [n for n, _ in model.named_parameters()]
    state = {k: v.clone() for k, v in model.state_dict().items()}
    assert pack_linears(model) == 2 * 7 + 1  # q k v o gate up down per layer, and the lm_head
    with torch.no_grad():
        got = model(ids).logits
    assert_same_up_to_rounding(got, want, "logits")
    assert [n for n, _ in model.named_parameters()] == names
    assert state.keys() == model.state_dict().keys()
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied weights stay tied
    assert unpack_linears(model) == 15 and not any(isinstance(m, PackedLinear) for m in model.modules())
    with torch.no_grad():
        assert torch.equal(model(ids).logits, want)  # unpacked: the eager product again


@needs_packing
def test_repack_follows_changed_weights_and_training_uses_the_plain_product():
    lin = torch.nn.Linear(32, 16, bias=False).to(torch.bfloat16)
    packed = PackedLinear(lin)
    x = torch.randn(3, 32, dtype=torch.bfloat16)
    with torch.no_grad():
        lin.weight.mul_(2)
    packed.repack()
    with torch.no_grad():
        assert_same_up_to_rounding(packed(x), lin(x), "repacked")
    packed.train()
    x.requires_grad_(True)
    packed(x).float().sum().backward()  # the packed op has no gradient: training takes the plain path
    assert x.grad is not None and packed.weight.grad is not None


@pytest.mark.skipif(not packing_available(torch.float32, "cpu"), reason="this torch build cannot pack float32 weights")
@pytest.mark.parametrize("shape", [(576, 576), (1536, 576), (576, 1536), (96, 1728)])
def test_packed_float32_outputs_equal_the_plain_product_up_to_rounding(shape):
    torch.manual_seed(0)
    lin = torch.nn.Linear(shape[1], shape[0]).to(torch.float32)
    packed = PackedLinear(lin)
    with torch.no_grad():
        for rows in (1, 2, 9, 16, 150):
            x = torch.randn(rows, shape[1])
            # oneDNN's float32 product against the BLAS's: the same precision, another order
            assert_same_up_to_rounding(packed(x), lin(x), f"{rows} rows")
    model = _tiny_llama(torch.float32)
    ids = torch.tensor([[1, 5, 9, 33, 7, 2]])
    with torch.no_grad():
        want = model(ids).logits
        assert pack_linears(model) == 15
        assert_same_up_to_rounding(model(ids).logits, want, "logits")


def test_other_dtypes_are_left_alone():
    model = _tiny_llama(torch.float64)
    assert packing_pays(model) is None
    assert pack_linears(model) == 0
    assert pack_if_it_pays(model, "tiny") is False


def test_the_packing_rule_allows_a_near_tie_but_not_a_loss():
    assert packing_decision([(1.0, 1.0), (1.0, 3.0)])  # a tie at one row, 3x at many: pack
    assert packing_decision([(1.04, 1.0), (1.0, 3.0)])  # within the slack
    assert not packing_decision([(1.2, 1.0), (1.0, 3.0)])  # 20% slower at one row: keep plain
    assert not packing_decision([(1.0, 1.0), (1.0, 1.0)])  # no faster anywhere
    assert packing_decision([(0.5, 1.0), (0.5, 1.0)])


@needs_packing
def test_pack_if_it_pays_follows_the_measurement(monkeypatch, capsys):
    import rheoplan.models.packed_linear as pl

    model = _tiny_llama()
    # only the oneDNN measurement is under test: the few-row kernel and the sibling fusion
    # are measured too, and on some CPUs (an AMD EPYC with AVX-512 bf16) the kernel wins on
    # this tiny model's matrices, which would replace linears whatever packing_pays says
    monkeypatch.setattr(pl, "few_rows_decision", lambda m, packed: (0, False))
    monkeypatch.setattr(pl, "fusing_decision", lambda *a: False)
    monkeypatch.setattr(pl, "packing_pays", lambda m: False)
    assert pl.pack_if_it_pays(model, "tiny") is False
    assert not any(isinstance(m, PackedLinear) for m in model.modules())
    assert "not packed" in capsys.readouterr().err
    monkeypatch.setattr(pl, "packing_pays", lambda m: True)
    assert pl.pack_if_it_pays(model, "tiny") is True
    assert sum(isinstance(m, PackedLinear) for m in model.modules()) == 15


def test_a_cpu_that_refuses_the_reorder_packs_nothing(monkeypatch):
    """oneDNN refuses the bfloat16 reorder on a CPU without AVX-512 or AVX-NE-CONVERT (an
    AVX2-only AMD EPYC raised it at load): packing is then unavailable for that dtype, and
    a model of that dtype loads unpacked instead of failing."""
    import rheoplan.models.packed_linear as pl

    real = torch.ops.mkldnn._reorder_linear_weight

    def refuse(w, *args):
        if w.dtype == torch.bfloat16:
            raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx_ne_convert "
                               "or avx512bw, avx512vl and avx512dq")
        return real(w, *args)

    pl._packs.cache_clear()
    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", refuse)
    try:
        assert not pl.packing_available(torch.bfloat16, "cpu")
        model = _tiny_llama()
        assert pl.packing_pays(model) is None
        pl.pack_if_it_pays(model, "tiny")  # may route few-row products to the numba kernel
        assert not any(m.onednn for m in model.modules() if isinstance(m, PackedLinear))
        assert pl.pack_linears(_tiny_llama()) == 0
        assert pl.packing_available(torch.float32, "cpu") == pl._packs(torch.float32)
    finally:
        monkeypatch.undo()
        pl._packs.cache_clear()


def test_few_row_products_run_the_numba_kernel_and_give_the_same_logits():
    """float32 few-row products through ``kernels/linear/cpu.py``: the same logits up to
    rounding, prefill-sized products left to torch, and ``unpacked`` brings back the kind."""
    from rheoplan.kernels.linear import cpu as kernel

    torch.manual_seed(0)
    model = _tiny_llama(torch.float32)
    short, long = torch.randint(0, 100, (1, 3)), torch.randint(0, 100, (1, kernel.MAX_ROWS + 4))
    with torch.no_grad():
        want_short, want_long = model(short).logits, model(long).logits
    assert pack_linears(model, onednn=False, few_rows=True) == 15
    kinds = {m.kind for m in model.modules() if isinstance(m, PackedLinear)}
    assert kinds == {"few-rows"}
    calls = []
    real = kernel._rows_times_weight
    try:
        kernel._rows_times_weight = lambda *a: (calls.append(a[0].shape[0]), real(*a))
        with torch.no_grad():
            assert_same_up_to_rounding(model(short).logits, want_short, "3 tokens")
            assert calls and set(calls) == {3}
            calls.clear()
            assert torch.equal(model(long).logits, want_long)  # more rows than MAX_ROWS: torch's product
            assert not calls
    finally:
        kernel._rows_times_weight = real
    from rheoplan.models.packed_linear import unpacked
    with unpacked(model):
        assert not any(isinstance(m, PackedLinear) for m in model.modules())
    assert {m.kind for m in model.modules() if isinstance(m, PackedLinear)} == {"few-rows"}
    with pytest.raises(ValueError, match="onednn=True or few_rows >= 1"):
        PackedLinear(torch.nn.Linear(4, 4), onednn=False, few_rows=False)
    for bad in (-1, kernel.MAX_ROWS + 1, 2.0):
        with pytest.raises(ValueError, match="few_rows=.* is out of range"):
            PackedLinear(torch.nn.Linear(4, 4), onednn=False, few_rows=bad)


def test_the_kernel_serves_the_span_of_rows_it_pays_in(monkeypatch):
    """``few_rows_span`` names the fewest timed row count from which the kernel pays at
    that count and every larger one, and whether it pays at a prefill's rows too;
    ``PackedLinear(few_rows=N, prefill=...)`` sends fewer rows, and more than ``MAX_ROWS``
    unless ``prefill``, to torch's product."""
    import rheoplan.models.packed_linear as pl
    from rheoplan.kernels.linear import cpu as kernel

    model = _tiny_llama(torch.float32)
    for kernel_ms, prefill_ms, want in (([1, 1, 1, 1, 1], 1, (1, True)), ([3, 1, 1, 1, 1], 3, (2, False)),
                                        ([1, 3, 1, 1, 1], 1, (4, True)), ([3, 3, 3, 3, 3], 1, (0, False)),
                                        ([1, 1, 1, 1, 3], 1, (0, False))):
        def timed(lins, new, old, rows, reps, k=kernel_ms, p=prefill_ms):
            return [(p, 2.0)] if rows == (pl.PREFILL_TIMED,) else [(t, 2.0) for t in k]
        monkeypatch.setattr(pl, "_time_pairs", timed)
        assert pl.few_rows_span(model, packed=False) == want, kernel_ms
    lin = torch.nn.Linear(8, 5)
    calls = []
    real = kernel._rows_times_weight
    one, two, many = torch.randn(1, 8), torch.randn(2, 8), torch.randn(kernel.MAX_ROWS + 3, 8)
    try:
        kernel._rows_times_weight = lambda *a: (calls.append(a[0].shape[0]), real(*a))
        with torch.no_grad():
            pk = PackedLinear(lin, onednn=False, few_rows=2)
            assert pk.kind == "few-rows from 2"
            assert torch.equal(pk(one), lin(one)) and not calls  # one row: torch's product
            assert_same_up_to_rounding(pk(two), lin(two), "two rows")
            assert torch.equal(pk(many), lin(many)) and calls == [2]  # beyond MAX_ROWS: torch's
            pk = PackedLinear(lin, onednn=False, few_rows=1, prefill=True)
            assert pk.kind == "few-rows and prefill"
            assert_same_up_to_rounding(pk(many), lin(many), "a prefill")
            assert calls == [2, kernel.MAX_ROWS + 3]
    finally:
        kernel._rows_times_weight = real
    with pytest.raises(ValueError, match="prefill=True needs few_rows"):
        PackedLinear(lin, onednn=True, few_rows=0, prefill=True)


def test_bfloat16_models_get_the_few_row_kernel_too_and_float16_ones_not():
    """bfloat16 few-row products through the kernel: the same logits up to bfloat16
    rounding; float16 (no kernel) is left alone."""
    from rheoplan.kernels.linear import cpu as kernel
    from rheoplan.models.packed_linear import few_rows_span

    torch.manual_seed(0)
    model = _tiny_llama(torch.bfloat16)
    ids = torch.randint(0, 100, (1, 3))
    with torch.no_grad():
        want = model(ids).logits
    assert pack_linears(model, onednn=False, few_rows=True) == 15
    calls = []
    real = kernel._rows_times_bfloat16_weight
    try:
        kernel._rows_times_bfloat16_weight = lambda *a: (calls.append(a[0].shape[0]), real(*a))
        with torch.no_grad():
            got = model(ids).logits
    finally:
        kernel._rows_times_bfloat16_weight = real
    assert set(calls) == {3}
    # 4 layers of bfloat16 roundings apart: close, not equal
    torch.testing.assert_close(got.float(), want.float(), rtol=0.05, atol=0.05)
    half = _tiny_llama(torch.float16)
    assert few_rows_span(half, packed=False) is None
    assert pack_linears(half, onednn=False, few_rows=True) == 0


def test_pack_if_it_pays_reports_both_decisions(monkeypatch, capsys):
    import rheoplan.models.packed_linear as pl

    monkeypatch.setenv("RHEOPLAN_REMEASURE", "1")  # each case measures (here: the patched rule)

    model = _tiny_llama(torch.float32)
    monkeypatch.setattr(pl, "packing_pays", lambda m: False)
    monkeypatch.setattr(pl, "fusing_pays", lambda m, *a: False)  # its own test: just below
    monkeypatch.setattr(pl, "few_rows_span", lambda m, packed: (1, False))
    assert pl.pack_if_it_pays(model, "tiny") is True
    err = capsys.readouterr().err
    assert "not packed" in err and "few-row numba kernel" in err
    assert {m.kind for m in model.modules() if isinstance(m, PackedLinear)} == {"few-rows"}
    model = _tiny_llama(torch.float32)
    monkeypatch.setattr(pl, "few_rows_span", lambda m, packed: (0, False))
    assert pl.pack_if_it_pays(model, "tiny") is False
    assert "keep torch's kernels" in capsys.readouterr().err
    model = _tiny_llama(torch.float32)
    monkeypatch.setattr(pl, "few_rows_span", lambda m, packed: (4, True))
    assert pl.pack_if_it_pays(model, "tiny") is True
    err = capsys.readouterr().err
    assert "products of 4 or more rows" in err and "at 4, 8, 32, 128 rows; fewer rows keep torch's" in err
    assert {m.kind for m in model.modules() if isinstance(m, PackedLinear)} == {"few-rows from 4 and prefill"}


def _counted_few_row_decisions(monkeypatch, tmp_path):
    """A fresh cache in ``tmp_path``, ``few_rows_span`` replaced by one that records its
    ``packed`` argument and says yes: ``(the module, the record, a float32 tiny model)``."""
    import rheoplan.models.packed_linear as pl

    monkeypatch.setenv("RHEOPLAN_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("RHEOPLAN_REMEASURE", raising=False)
    calls = []
    monkeypatch.setattr(pl, "few_rows_span", lambda m, packed: calls.append(packed) or (1, False))
    return pl, calls, _tiny_llama(torch.float32)


def test_the_few_row_decision_is_cached_per_machine_and_matrices(monkeypatch, tmp_path):
    pl, calls, model = _counted_few_row_decisions(monkeypatch, tmp_path)
    assert pl.few_rows_decision(model, packed=False) == (1, False)
    assert pl.few_rows_decision(model, packed=False) == (1, False) and calls == [False]  # read back
    assert (tmp_path / pl.FEW_ROWS_CACHE).exists()
    pl.few_rows_decision(model, packed=True)  # another key
    assert calls == [False, True]
    pl.few_rows_decision(_tiny_llama(torch.bfloat16), packed=False)  # another dtype, another record
    assert calls == [False, True, False]
    monkeypatch.setenv("RHEOPLAN_REMEASURE", "1")
    pl.few_rows_decision(model, packed=False)
    assert calls == [False, True, False, False]
    assert pl.few_rows_decision(_tiny_llama(torch.float16), packed=False) is None  # not served


def test_the_few_row_path_sees_in_place_weight_changes_and_checks_its_input():
    """``PackedLinear``'s few-row path reads the parameter through a numpy view (no copy):
    a weight changed in place is the weight multiplied; a wrong feature count is torch's
    error, not a read past the weight; autograd and long inputs take torch's product."""
    from rheoplan.kernels.linear import cpu as kernel

    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 5)
    pk = PackedLinear(lin, onednn=False, few_rows=True)
    x = torch.randn(2, 3, 8)
    with torch.no_grad():
        assert_same_up_to_rounding(pk(x), lin(x), "a [2, 3, 8] input")
        lin.weight.mul_(2.0)  # in place: the kernel's view sees it
        assert_same_up_to_rounding(pk(x), lin(x), "after an in-place change")
        with pytest.raises(RuntimeError):
            pk(torch.randn(4, 6))  # 24 numbers: 3 rows of 8, were the feature count not checked
        many = torch.randn(kernel.MAX_ROWS + 1, 8)
        assert torch.equal(pk(many), lin(many))  # torch's product beyond MAX_ROWS
    with torch.no_grad():  # an input that requires a gradient, autograd off: torch's product
        assert torch.equal(pk(x.clone().requires_grad_()), lin(x))
    y = pk(x.requires_grad_())  # autograd on: torch's product, gradients flow
    y.sum().backward()
    assert x.grad is not None and lin.weight.grad is not None
    pk.eval()  # not training either: still torch's product while autograd needs it
    x.grad = None
    pk(x).sum().backward()
    assert x.grad is not None


def test_records_timed_with_another_kernel_version_are_measured_again(monkeypatch, tmp_path):
    pl, calls, model = _counted_few_row_decisions(monkeypatch, tmp_path)
    pl.few_rows_decision(model, packed=False)
    monkeypatch.setattr(pl.few_row_kernel, "VERSION", "another blocking")
    pl.few_rows_decision(model, packed=False)
    assert calls == [False, False]
    import rheoplan.loading as loading

    monkeypatch.setattr(loading, "fold_pays", lambda m, rows: False)  # the attention's own tag: elsewhere
    monkeypatch.setattr(loading, "lean_note", lambda m: None)  # the lean forward's too
    pack_linears(model, onednn=False, few_rows=True)
    assert loading.speed_tag(model) == " few-rows (another blocking)"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_siblings_give_their_own_products_bit_for_bit_and_keep_the_parameters(dtype):
    """``pack_linears(fuse=True)``: a layer's q / k / v and gate / up run as one product per
    set (``FusedPart``); through the few-row kernel each part's columns are the bits its own
    product gives (the kernel's sums do not depend on the weight rows beside them), the
    parameters and ``state_dict`` are the model's own, and unpacking restores ``nn.Linear``."""
    import rheoplan.models.packed_linear as pl

    torch.manual_seed(0)
    model = _tiny_llama(dtype)
    names = [n for n, _ in model.named_parameters()]
    state = {k: v.clone() for k, v in model.state_dict().items()}
    ids = [torch.randint(0, 100, (1, r)) for r in (1, 2, 3, 9)]
    assert pack_linears(model, onednn=False, few_rows=True) == 15
    with torch.no_grad():
        want = [model(i).logits for i in ids]
    unpack_linears(model)
    assert pack_linears(model, onednn=False, few_rows=True, fuse=True) == 15
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert all(type(m) is pl.FusedPart for m in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj))
    assert type(attn.o_proj) is PackedLinear and type(mlp.down_proj) is PackedLinear
    assert attn.q_proj._shared is attn.v_proj._shared and attn.q_proj._shared is not mlp.up_proj._shared
    assert {m.kind for m in model.modules() if isinstance(m, PackedLinear)} == {"few-rows", "few-rows fused"}
    with torch.no_grad():
        for i, w in zip(ids, want):
            assert torch.equal(model(i).logits, w), f"{i.shape[1]} tokens"
    assert [n for n, _ in model.named_parameters()] == names
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())
    with pl.unpacked(model):
        assert not any(isinstance(m, PackedLinear) for m in model.modules())
    assert type(model.model.layers[1].mlp.gate_proj) is pl.FusedPart  # fused again after the block
    assert unpack_linears(model) == 15 and not any(isinstance(m, PackedLinear) for m in model.modules())


def test_the_shared_product_is_named_only_for_a_whole_set_in_its_order():
    """``shared_product``: the one product behind every part of a set, in the set's order
    (its columns are the parts' outputs, part after part); anything else gets None."""
    import rheoplan.models.packed_linear as pl

    torch.manual_seed(0)
    model = _tiny_llama(torch.bfloat16)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert pl.shared_product(attn.q_proj, attn.k_proj, attn.v_proj) is None  # plain nn.Linear
    pack_linears(model, onednn=False, few_rows=True, fuse=True)
    product = pl.shared_product(attn.q_proj, attn.k_proj, attn.v_proj)
    assert product is attn.q_proj._shared.product
    x = torch.randn(2, attn.q_proj.in_features).to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(product(x), torch.cat([m(x) for m in (attn.q_proj, attn.k_proj, attn.v_proj)], -1))
    assert pl.shared_product(mlp.gate_proj, mlp.up_proj) is mlp.gate_proj._shared.product
    for parts in ((attn.q_proj, attn.k_proj), (attn.k_proj, attn.q_proj, attn.v_proj), (mlp.up_proj, mlp.gate_proj),
                  (attn.q_proj, attn.k_proj, model.model.layers[1].self_attn.v_proj), (attn.o_proj,)):
        assert pl.shared_product(*parts) is None


def test_a_shared_product_runs_once_per_input_and_again_for_a_changed_one():
    """The parts of a set share one product per input tensor; an input changed in place, or
    another input, gets a product of its own (never a stale result), as does each part of
    an inference tensor; where autograd records, a part runs its own product (gradients
    reach its weight); ``repack`` follows changed weights."""
    import threading

    torch.manual_seed(0)
    lins = [torch.nn.Linear(8, n, bias=True) for n in (8, 4, 4)]
    parent = torch.nn.Module()
    for name, lin in zip(("q_proj", "k_proj", "v_proj"), lins):
        setattr(parent, name, lin)
    assert pack_linears(parent, onednn=False, few_rows=True, fuse=True) == 3
    parts = [parent.q_proj, parent.k_proj, parent.v_proj]
    shared = parts[0]._shared
    products = []
    real = shared.product.forward
    shared.product.forward = lambda x: products.append(1) or real(x)

    def check(x, what):
        for part, lin in zip(parts, lins):
            assert_same_up_to_rounding(part(x), lin(x), what)

    with torch.no_grad():
        x = torch.randn(3, 8)
        check(x, "one input")
        assert len(products) == 1
        x0, q = x.clone(), parts[0](x)
        x.mul_(3.0)  # changed in place between two parts: a fresh product
        assert_same_up_to_rounding(parts[1](x), lins[1](x), "after an in-place change")
        assert len(products) == 3
        assert_same_up_to_rounding(q, lins[0](x0), "a part taken before the change keeps its values")
        y = torch.randn(2, 8)
        assert_same_up_to_rounding(parts[2](y), lins[2](y), "another input")
        other = []  # another Python thread keeps its own result
        def in_thread():
            with torch.no_grad():  # autograd's switch is per thread too
                other.append(parts[0](torch.ones(1, 8)))

        t = threading.Thread(target=in_thread)
        parts[0](x)
        n = len(products)
        t.start(), t.join()
        assert_same_up_to_rounding(other[0], lins[0](torch.ones(1, 8)), "another thread")
        assert len(products) == n + 1  # the thread's own product
        assert_same_up_to_rounding(parts[1](x), lins[1](x), "kept across the other thread's call")
        assert len(products) == n + 1
    with torch.inference_mode():
        z = torch.randn(2, 8)
        check(z, "an inference tensor")
    parent.eval()  # not training: what sends a part to its own product is autograd alone
    x = torch.randn(2, 8, requires_grad=True)
    parts[1](x).sum().backward()
    assert lins[1].weight.grad is not None and x.grad is not None
    with torch.no_grad():
        lins[2].weight.add_(1.0)
        parts[2].repack()
        check(torch.randn(4, 8), "after repack")


def test_the_fusing_decision_is_measured_cached_and_reported(monkeypatch, tmp_path, capsys):
    import rheoplan.models.packed_linear as pl

    monkeypatch.setenv("RHEOPLAN_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("RHEOPLAN_REMEASURE", raising=False)
    model = _tiny_llama(torch.float32)
    assert type(pl.fusing_pays(model, False, 1, False, reps=1)) is bool  # really timed
    calls = []
    monkeypatch.setattr(pl, "fusing_pays", lambda m, *a: calls.append(a) or True)
    assert pl.fusing_decision(model, False, 1, False) is True
    assert pl.fusing_decision(model, False, 1, False) is True and len(calls) == 1  # read back
    pl.fusing_decision(model, False, 2, True)  # other settings, another record
    assert len(calls) == 2
    assert pl.fusing_decision(_tiny_llama(torch.float16), False, 1, False) is None  # nothing packs float16
    monkeypatch.setattr(pl, "packing_pays", lambda m: False)
    monkeypatch.setattr(pl, "few_rows_span", lambda m, packed: (1, False))
    monkeypatch.setenv("RHEOPLAN_REMEASURE", "1")
    assert pl.pack_if_it_pays(model, "tiny") is True
    assert "10 sibling projections (q / k / v, gate / up) run as one product" in capsys.readouterr().err
    model = _tiny_llama(torch.float32)
    monkeypatch.setattr(pl, "fusing_pays", lambda m, *a: False)
    assert pl.pack_if_it_pays(model, "tiny") is True
    assert "sibling projections run apart" in capsys.readouterr().err
    assert not any(isinstance(m, pl.FusedPart) for m in model.modules())


def test_the_kernel_weight_is_named_only_where_forward_runs_the_bfloat16_kernel_alone():
    """``bfloat16_kernel_weight``: the weight array of a bfloat16 ``PackedLinear`` without a
    bias whose kernel serves these rows, while no gradient is recorded; None for anything
    ``forward`` would compute otherwise."""
    from rheoplan.kernels.linear import cpu as kernel
    from rheoplan.models.packed_linear import bfloat16_kernel_weight

    torch.manual_seed(0)
    plain = torch.nn.Linear(16, 8, bias=False).bfloat16()
    from_two = PackedLinear(plain, onednn=False, few_rows=2)
    with torch.no_grad():
        assert bfloat16_kernel_weight(from_two, 2) is from_two._rows_w
        assert bfloat16_kernel_weight(from_two, kernel.MAX_ROWS) is from_two._rows_w
        assert bfloat16_kernel_weight(from_two, 1) is None  # below the span
        assert bfloat16_kernel_weight(from_two, kernel.MAX_ROWS + 1) is None  # above it, no prefill
        assert bfloat16_kernel_weight(PackedLinear(plain, onednn=False, few_rows=1, prefill=True), 100) is not None
        biased = torch.nn.Linear(16, 8).bfloat16()
        assert bfloat16_kernel_weight(PackedLinear(biased, onednn=False, few_rows=1), 1) is None
        assert bfloat16_kernel_weight(PackedLinear(plain.float(), onednn=False, few_rows=1), 1) is None
        assert bfloat16_kernel_weight(plain, 1) is None
    assert bfloat16_kernel_weight(from_two, 2) is None  # gradients recorded: forward may take torch's


def test_siblings_that_cannot_share_a_product_stay_apart():
    """Siblings with another input width, or a bias where the others have none, are packed
    each on its own (and ``fusing_pays`` finds nothing to time)."""
    import rheoplan.models.packed_linear as pl

    for k_proj in (torch.nn.Linear(6, 4, bias=False), torch.nn.Linear(8, 4, bias=True)):
        parent = torch.nn.Module()
        parent.q_proj, parent.k_proj, parent.v_proj = torch.nn.Linear(8, 8, bias=False), k_proj, \
            torch.nn.Linear(8, 4, bias=False)
        assert pl.fusing_pays(parent, False, 1, False) is None
        assert pack_linears(parent, onednn=False, few_rows=True, fuse=True) == 3
        assert not any(isinstance(m, pl.FusedPart) for m in parent.modules())
        assert all(type(m) is PackedLinear for m in (parent.q_proj, parent.k_proj, parent.v_proj))
