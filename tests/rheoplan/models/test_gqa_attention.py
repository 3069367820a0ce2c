"""The masked grouped-query attention equals transformers' ``sdpa`` bit for bit: the
function alone, and a tree verify forward, a batched forward and a prefill of a GQA
model, each with and without the switch; and it is chosen only where it pays."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import rheoplan.models._hf_common as _hf_common
import rheoplan.models.gqa_attention as gqa
from rheoplan.models._hf_common import base_model, new_cache, run_base, run_base_rows
from rheoplan.models.gqa_attention import GQA_ATTENTION, gqa_attention_active, gqa_pays, sdpa_gqa_forward


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


def _tree_forward(model, switch_on: bool, monkeypatch):
    monkeypatch.setattr(gqa, "gqa_pays", (lambda m: True) if switch_on else (lambda m: False))
    base = base_model(model)
    cache = new_cache(model)
    prompt = torch.tensor([3, 9, 4, 11, 7])
    h0 = run_base(base, cache, prompt, torch.arange(5), torch.ones(5, 5, dtype=torch.bool).tril())
    # a tree of 4 nodes: root 0 -> 1, 2; 1 -> 3
    allowed = torch.ones(4, 9, dtype=torch.bool)
    allowed[:, 5:] = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    h1 = run_base(base, cache, torch.tensor([2, 8, 13, 5]), torch.tensor([5, 6, 6, 7]), allowed)
    return h0, h1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_masked_forwards_equal_with_and_without_the_switch(dtype, monkeypatch):
    model = _llama(dtype=dtype)
    calls = []
    real = gqa.sdpa_gqa_forward
    monkeypatch.setattr(gqa, "sdpa_gqa_forward", lambda *a, **k: calls.append(1) or real(*a, **k))
    with torch.no_grad():
        on = _tree_forward(model, True, monkeypatch)
        off = _tree_forward(model, False, monkeypatch)
    assert calls, "the switch never reached the GQA attention"
    for a, b in zip(on, off):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_rows_equal_with_and_without_the_switch(dtype, monkeypatch):
    model = _llama(dtype=dtype)
    base = base_model(model)
    ids = torch.tensor([[1, 5, 9, 2], [4, 4, 8, 3]])
    pos = torch.tensor([[0, 1, 2, 3], [0, 0, 1, 2]])
    allowed = torch.ones(2, 4, 4, dtype=torch.bool).tril()
    allowed[1, :, 0] = False  # row 1 is left-padded
    allowed[1, 0, 0] = True
    outs = []
    for on in (True, False):
        monkeypatch.setattr(gqa, "gqa_pays", lambda m, on=on: on)
        with torch.no_grad():
            outs.append(run_base_rows(base, new_cache(model), ids, pos, allowed))
    assert torch.equal(outs[0], outs[1])


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
