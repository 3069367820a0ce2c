"""The masked grouped-query attention equals transformers' ``sdpa``: bit for bit with
``enable_gqa``, up to rounding with the query heads folded (and exactly the attention a
float64 reference computes); the function alone, and a tree verify forward, a batched
forward and a prefill of a GQA model, each with and without the switch; and each is chosen
only where it pays."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import rheoplan.models._hf_common as _hf_common
import rheoplan.models.gqa_attention as gqa
from rheoplan.models._hf_common import base_model, new_cache, run_base, run_base_rows
from rheoplan.models.gqa_attention import (GQA_ATTENTION, gqa_attention_active, gqa_pays, sdpa_fold_forward,
                                          sdpa_gqa_forward)


def _llama(kv_heads: int = 2, dtype=torch.float32) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=kv_heads, num_hidden_layers=2,
                      intermediate_size=64, vocab_size=50, attn_implementation="sdpa")
    return LlamaForCausalLM(cfg).to(dtype).eval()


class _Groups(torch.nn.Module):
    num_key_value_groups = 3
    is_causal = True


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv", [7, 40])
def test_sdpa_gqa_forward_equals_transformers_sdpa(dtype, kv):
    g = torch.Generator().manual_seed(kv)
    q = torch.randn(2, 6, 5, 16, generator=g).to(dtype)
    k, v = (torch.randn(2, 2, kv, 16, generator=g).to(dtype) for _ in range(2))
    allowed = torch.rand(2, 1, 5, kv, generator=g) < 0.7
    allowed[..., 0] = True
    mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)
    want, _ = sdpa_attention_forward(_Groups(), q, k, v, mask, scaling=0.25)
    got, _ = sdpa_gqa_forward(_Groups(), q, k, v, mask, scaling=0.25)
    assert torch.equal(got, want)


def _tree_forward(model, switch_on: bool, monkeypatch, fold: bool = False):
    monkeypatch.setattr(gqa, "gqa_pays", (lambda m: True) if switch_on else (lambda m: False))
    monkeypatch.setattr(gqa, "fold_pays", lambda m, rows: fold)
    base = base_model(model)
    cache = new_cache(model)
    prompt = torch.tensor([3, 9, 4, 11, 7])
    h0 = run_base(base, cache, prompt, torch.arange(5), torch.ones(5, 5, dtype=torch.bool).tril())
    # a tree of 4 nodes: root 0 -> 1, 2; 1 -> 3
    allowed = torch.ones(4, 9, dtype=torch.bool)
    allowed[:, 5:] = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    h1 = run_base(base, cache, torch.tensor([2, 8, 13, 5]), torch.tensor([5, 6, 6, 7]), allowed)
    return h0, h1


def _assert_same(got, want, fold: bool, dtype):
    """Bit for bit with ``enable_gqa``; up to rounding folded (its sums may be grouped
    differently by the kernel)."""
    if not fold:
        assert torch.equal(got, want)
    else:
        tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
        torch.testing.assert_close(got, want, **tol)


@pytest.mark.parametrize("fold", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_masked_forwards_equal_with_and_without_the_switch(dtype, fold, monkeypatch):
    model = _llama(dtype=dtype)
    calls = []
    name = "sdpa_fold_forward" if fold else "sdpa_gqa_forward"
    real = getattr(gqa, name)
    monkeypatch.setattr(gqa, name, lambda *a, **k: calls.append(1) or real(*a, **k))
    with torch.no_grad():
        on = _tree_forward(model, True, monkeypatch, fold)
        off = _tree_forward(model, False, monkeypatch)
    assert calls, f"the switch never reached {name}"
    for a, b in zip(on, off):
        _assert_same(a, b, fold, dtype)


@pytest.mark.parametrize("fold", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_rows_equal_with_and_without_the_switch(dtype, fold, monkeypatch):
    model = _llama(dtype=dtype)
    base = base_model(model)
    ids = torch.tensor([[1, 5, 9, 2], [4, 4, 8, 3]])
    pos = torch.tensor([[0, 1, 2, 3], [0, 0, 1, 2]])
    allowed = torch.ones(2, 4, 4, dtype=torch.bool).tril()
    allowed[1, :, 0] = False  # row 1 is left-padded
    allowed[1, 0, 0] = True
    monkeypatch.setattr(gqa, "fold_pays", lambda m, rows: fold)
    outs = []
    for on in (True, False):
        monkeypatch.setattr(gqa, "gqa_pays", lambda m, on=on: on)
        with torch.no_grad():
            outs.append(run_base_rows(base, new_cache(model), ids, pos, allowed))
    _assert_same(outs[0], outs[1], fold, dtype)


def test_chosen_only_for_cpu_sdpa_with_grouped_heads():
    assert gqa_pays(_llama(kv_heads=2))
    assert not gqa_pays(_llama(kv_heads=4))  # one key/value head per query head: nothing to copy
    eager = _llama(kv_heads=2)
    eager.config._attn_implementation = "eager"
    assert not gqa_pays(eager)


def test_active_only_with_a_mask_and_several_queries_and_restored_on_error():
    model = _llama()
    for mask, queries in ((None, 5), (torch.zeros(1), 1)):
        with gqa_attention_active(model, mask, queries):
            assert model.config._attn_implementation == "sdpa"
    with pytest.raises(KeyError):
        with gqa_attention_active(model, torch.zeros(1), 2):
            assert model.config._attn_implementation == GQA_ATTENTION
            raise KeyError("boom")
    assert model.config._attn_implementation == "sdpa"


def test_unmasked_call_is_refused():
    q = torch.zeros(1, 4, 1, 8)
    with pytest.raises(RuntimeError, match="masked forwards only"):
        sdpa_gqa_forward(_Groups(), q, q[:, :2], q[:, :2], None)


# -- one query, no mask: an all-zero mask where it measured faster ------------------------------


def _one_token_step(model, pays: bool, monkeypatch) -> tuple[torch.Tensor, list]:
    """A prompt's forward, then a one-token step; returns the step's hidden state and the
    mask each forward passed to the decoder stack."""
    monkeypatch.setattr(_hf_common, "one_query_mask_pays", lambda base: pays)
    base = base_model(model)
    masks = []
    real = base.forward
    monkeypatch.setattr(base, "forward", lambda *a, **k: masks.append(k.get("attention_mask")) or real(*a, **k))
    cache = new_cache(model)
    with torch.no_grad():
        run_base(base, cache, torch.tensor([3, 9, 4, 11]), torch.arange(4), torch.ones(4, 4, dtype=torch.bool).tril())
        h = run_base(base, cache, torch.tensor([7]), torch.tensor([4]), None, all_allowed=True)
    return h, masks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_token_step_with_a_zero_mask_is_the_same_attention(dtype, monkeypatch):
    model = _llama(dtype=dtype)
    plain, plain_masks = _one_token_step(model, False, monkeypatch)
    masked, masks = _one_token_step(model, True, monkeypatch)
    assert plain_masks[1] is None
    assert masks[1].shape == (1, 1, 1, 5) and not masks[1].any()  # 4 cached + the new token, all zero
    # transformers folds the query heads of a group with a mask (its one-query path) and uses
    # enable_gqa without: the same attention, summed in another order
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(masked, plain, **tol)
    # and what transformers computes for that mask in an ordinary call
    base = base_model(model)
    with torch.no_grad():
        cache = new_cache(model)
        base(input_ids=torch.tensor([[3, 9, 4, 11]]), use_cache=True, **{_hf_common._cache_kwarg(base): cache})
        want = base(input_ids=torch.tensor([[7]]), position_ids=torch.tensor([[4]]),
                    attention_mask=torch.zeros(1, 1, 1, 5, dtype=dtype), use_cache=True,
                    **{_hf_common._cache_kwarg(base): cache}).last_hidden_state[0]
    assert torch.equal(masked, want)


def test_one_query_choice_follows_the_measurement(monkeypatch):
    model = _llama(kv_heads=2)
    key = gqa.attention_shape(model)
    monkeypatch.setitem(gqa._ONE_QUERY, key, (100.0, 10.0))
    assert gqa.one_query_mask_pays(model)
    monkeypatch.setitem(gqa._ONE_QUERY, key, (100.0, 90.0))  # under 20% faster: keep generate's path
    assert not gqa.one_query_mask_pays(model)


def test_one_query_timings_measure_only_grouped_sdpa_models():
    gqa._ONE_QUERY.pop(gqa.attention_shape(_llama(kv_heads=2)), None)
    t = gqa.one_query_timings(_llama(kv_heads=2))
    assert t is not None and all(v > 0 for v in t)
    assert gqa.one_query_timings(_llama(kv_heads=4)) is None  # nothing grouped: nothing to choose
    eager = _llama(kv_heads=2)
    eager.config._attn_implementation = "eager"
    assert gqa.one_query_timings(eager) is None and not gqa.one_query_mask_pays(eager)


# -- several queries, a mask: the query heads folded where it measured faster ------------------


def _attention_reference(q, k, v, mask, scale):
    """Grouped-query attention in float64 from its definition: query head ``h`` attends
    with key/value head ``h // g``."""
    g = q.shape[1] // k.shape[1]
    k, v = (t.double().repeat_interleave(g, dim=1) for t in (k, v))
    w = (q.double() @ k.transpose(-1, -2)) * scale + mask.double()
    return (w.softmax(-1) @ v).transpose(1, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("rows, queries, kv", [(1, 5, 9), (3, 4, 30), (2, 1, 12)])
def test_folded_attention_is_the_grouped_attention(dtype, rows, queries, kv):
    g = torch.Generator().manual_seed(rows * 100 + queries)
    # the query as a decoder layer hands it over: a transposed view
    q = torch.randn(rows, queries, 6, 16, generator=g).to(dtype).transpose(1, 2)
    k, v = (torch.randn(rows, 2, kv, 16, generator=g).to(dtype) for _ in range(2))
    allowed = torch.rand(rows, 1, queries, kv, generator=g) < 0.6  # every query row its own mask
    allowed[..., 0] = True
    mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)
    got, _ = sdpa_fold_forward(_Groups(), q, k, v, mask, scaling=0.25)
    want = _attention_reference(q, k, v, mask, 0.25)
    assert got.shape == (rows, queries, 6, 16)
    torch.testing.assert_close(got.double(), want, rtol=1e-5 if dtype == torch.float32 else 1e-12,
                               atol=1e-5 if dtype == torch.float32 else 1e-12)
    # and transformers' sdpa of the same call, up to float32 rounding
    ref, _ = sdpa_attention_forward(_Groups(), q, k, v, mask, scaling=0.25)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_a_mask_with_a_head_axis_is_not_folded():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 6, 3, 16, generator=g)
    k, v = (torch.randn(2, 2, 7, 16, generator=g) for _ in range(2))
    mask = torch.zeros(2, 6, 3, 7).masked_fill_(torch.rand(2, 6, 3, 7, generator=g) < 0.3, -1e30)
    mask[..., 0] = 0.0
    got, _ = sdpa_fold_forward(_Groups(), q, k, v, mask)
    want, _ = sdpa_gqa_forward(_Groups(), q, k, v, mask)
    assert torch.equal(got, want)


def test_the_folded_mask_is_kept_for_one_forward_and_refolded_when_written():
    mask = torch.zeros(1, 1, 2, 6)
    mask[0, 0, 0, 3:] = -1e30
    first = gqa.folded_mask(mask, 5, 3)
    assert first.shape == (1, 1, 6, 5)
    assert torch.equal(first[0, 0], mask[0, 0, :, :5].repeat(3, 1))  # row j * q + t is row t
    assert gqa.folded_mask(mask, 5, 3) is first  # the next layer of the same forward
    assert gqa.folded_mask(mask, 6, 3).shape == (1, 1, 6, 6)  # another length: folded again
    assert gqa.folded_mask(mask, 5, 3)[0, 0, 1, 1] == 0
    mask[0, 0, 1, 1] = -1e30  # written in place (a reused buffer): folded again
    again = gqa.folded_mask(mask, 5, 3)
    assert again[0, 0, 1, 1] == -1e30 and again[0, 0, 3, 1] == -1e30 and again[0, 0, 5, 1] == -1e30


def test_fold_choice_follows_the_measurement_per_row_count(monkeypatch):
    model = _llama(kv_heads=2)
    key = gqa.attention_shape(model)
    # one row: no faster than the margin; batches: twice as fast
    monkeypatch.setitem(gqa._FOLD, key, {1: (100.0, 80.0), 4: (100.0, 50.0)})
    assert not gqa.fold_pays(model, 1)
    assert gqa.fold_pays(model, 2) and gqa.fold_pays(model, 16)
    mask = torch.zeros(3, 1, 2, 4)
    with gqa_attention_active(model, mask, 2):
        assert model.config._attn_implementation == gqa.FOLD_ATTENTION
    with gqa_attention_active(model, mask[:1], 2):
        assert model.config._attn_implementation == GQA_ATTENTION
    assert "one row enable_gqa" in gqa.fold_note(model) and "batches fold" in gqa.fold_note(model)


def test_fold_timings_measure_only_grouped_sdpa_models():
    model = _llama(kv_heads=2)
    gqa._FOLD.pop(gqa.attention_shape(model), None)
    t = gqa.fold_timings(model, reps=2)
    assert sorted(t) == sorted(r for r, _, _ in gqa.FOLD_PROBES) and all(x > 0 for p in t.values() for x in p)
    assert gqa.fold_timings(_llama(kv_heads=4)) is None
    assert not gqa.fold_pays(_llama(kv_heads=4), 4)
