"""Loading helpers: an EAGLE-3 head in the asked dtype, 'auto' by measurement."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import rheoplan.loading as loading
from rheoplan.config import SamplingConfig, TreeConfig
from rheoplan.decode import plan_and_decode
from rheoplan.models.eagle3 import Eagle3Config, Eagle3Head, save_eagle3


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                         num_attention_heads=4, num_key_value_heads=2)).eval()
    ckpt = tmp_path_factory.mktemp("head")
    save_eagle3(Eagle3Head(Eagle3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                        num_key_value_heads=2)), ckpt)
    return model, ckpt


def _dtype(draft):
    return next(draft.head.parameters()).dtype


@pytest.mark.parametrize("asked, picked, want", [
    ("float32", None, torch.float32), ("bfloat16", None, torch.bfloat16),
    ("auto", torch.bfloat16, torch.bfloat16), ("auto", torch.float32, torch.float32),
])
def test_load_head_in_the_asked_or_measured_dtype(tiny, monkeypatch, asked, picked, want):
    model, ckpt = tiny
    seen = []

    def choose(head, head_id, target):
        assert target is model  # timed after the target's output projection
        seen.append(head_id)
        return picked, {}

    monkeypatch.setattr(loading, "choose_head_dtype", choose)
    draft = loading.load_head(ckpt, model, asked)
    assert _dtype(draft) is want
    assert seen == ([f"eagle3:{ckpt.resolve()}"] if asked == "auto" else [])


def test_load_head_refuses_an_unknown_dtype(tiny):
    with pytest.raises(ValueError, match=r"draft_dtype='fp16' is not one of"):
        loading.load_head(tiny[1], tiny[0], "fp16")


@pytest.mark.parametrize("method, pick_by", [("autoregressive", "one"), ("rheo", "tree")])
def test_auto_dtype_is_picked_by_the_forward_the_method_runs(tiny, monkeypatch, method, pick_by):
    model, ckpt = tiny
    seen = []

    def choose(m, model_id, pick_by):
        seen.append(pick_by)
        return torch.float32, {}

    monkeypatch.setattr(loading, "load_smollm2", lambda dtype: (model, None))
    monkeypatch.setattr(loading, "choose_dtype", choose)
    monkeypatch.setattr(loading, "pack_if_it_pays", lambda m, what: None)
    got, _, draft = loading.load_default(method=method, draft=f"eagle3:{ckpt}", dtype="auto", draft_dtype="float32")
    assert got is model and seen == [pick_by] and (draft is None) == (method == "autoregressive")


def test_one_row_cost_model_reads_one_rows_record_then_a_batched_one_then_measures_one_row(monkeypatch):
    """``batched=False`` (``rheoplan generate`` with one prompt): a cached one-row record
    serves first, then a cached batched one; without either only one row's prices are
    measured (``batch_sizes=()``). ``batched=True`` asks for the batched record, as before."""
    from rheoplan import TreeConfig
    from rheoplan.costmodel import Timings

    one = Timings((1, 64), (10.0, 73.0), (12.0, 75.0), 0, 1000, (1, 4), (0.5, 1.0), 0.5, 0.5)
    full = Timings((1, 64), (11.0, 70.0), (12.0, 75.0), 0, 1000, (1, 4), (0.5, 1.0), 0.5, 0.5,
                   (1, 4), (1, 2), ((10.0, 11.0), (12.0, 14.0)))
    tree = TreeConfig(depth=3, frontier=2, slots=2, budget=6, rheostat=1, support=5)
    cached, calls = {}, []

    def measure(*a, cached_only=False, batch_sizes=None, **k):
        key = "one" if batch_sizes == () else "full"
        calls.append((key, cached_only))
        if cached_only:
            return cached.get(key)
        cached[key] = one if key == "one" else full
        return cached[key]

    monkeypatch.setattr(loading, "measure_timings", measure)
    monkeypatch.setattr(loading, "encode_prompt", lambda *a, **k: [0])
    load = lambda **k: loading.load_cost_model(None, None, None, tree, calibration="none", **k)  # noqa: E731
    assert load(batched=True).timings is full and calls == [("full", False)]  # nothing cached: measured
    calls.clear()
    del cached["full"]
    assert load(batched=False).timings is one  # nothing cached: one row measured
    assert calls == [("one", True), ("full", True), ("one", False)]
    calls.clear()
    cached["full"] = full
    assert load(batched=False).timings is one and calls == [("one", True)]  # one row's record first
    calls.clear()
    del cached["one"]
    assert load(batched=False).timings is full and calls == [("one", True), ("full", True)]  # then a batched one
    with pytest.raises(TypeError, match="batched='no'"):
        load(batched="no")


def test_speed_tag_names_the_attention_fold_so_latencies_timed_without_it_are_measured_again(tiny, monkeypatch):
    model, ckpt = tiny
    monkeypatch.setattr(loading, "lean_note", lambda m: None)  # its tag: tests/rheoplan/models/test_lean_llama.py
    for one_row, batches, want in ((False, False, ""), (False, True, " fold-batches"),
                                   (True, True, " fold-rows fold-batches")):
        monkeypatch.setattr(loading, "fold_pays", lambda m, rows, o=one_row, b=batches: o if rows == 1 else b)
        assert loading.speed_tag(model) == want
    head = loading.load_head(ckpt, model, "float32").head
    monkeypatch.setattr(loading, "fold_pays", lambda m, rows: True)
    assert "fold" not in loading.speed_tag(head)  # the head attends its own way


@pytest.mark.parametrize("unfused, fused, same, want", [
    ([20.0, 22.0, 24.0], [18.0, 20.0, 23.0], True, True),  # faster and the same bits: fused
    ([20.0, 22.0, 24.0], [21.0, 22.0, 24.0], True, False),  # no faster
    ([20.0, 22.0, 24.0], [18.0, 20.0, 23.0], False, False),  # faster, but other outputs
])
def test_the_decoder_glue_is_fused_where_it_measured_faster_with_the_same_bits(monkeypatch, tmp_path, capsys,
                                                                               unfused, fused, same, want):
    from rheoplan.kernels.decoder_glue import cpu
    from rheoplan.models.lean_llama import fuse_glue, glue_fused

    if not cpu.norm_applies():
        pytest.skip("torch's summation order not found on this CPU")
    monkeypatch.setenv("RHEOPLAN_CACHE_DIR", str(tmp_path))
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2)).eval()
    calls = []
    monkeypatch.setattr(loading, "glue_timings", lambda m: calls.append(m) or (unfused, fused, same))
    assert not loading.fuse_glue_if_it_pays(model, "target")  # float32: nothing to fuse, nothing timed
    assert calls == [] and not glue_fused(model.model)
    model = model.to(torch.bfloat16)
    try:
        assert loading.fuse_glue_if_it_pays(model, "target") is want
        assert glue_fused(model.model) is want and len(calls) == 1
        assert ("fused into one numba call each" in capsys.readouterr().err) is want
        fuse_glue(model.model, False)
        assert loading.fuse_glue_if_it_pays(model, "target") is want  # from the cache: not timed again
        assert len(calls) == 1
    finally:
        fuse_glue(model.model, False)


def test_the_heads_glue_is_fused_where_the_targets_is_and_gives_the_same_bits(tiny, monkeypatch, capsys):
    from rheoplan.models.lean_llama import fuse_glue

    model, ckpt = tiny
    base = model.model
    try:
        fuse_glue(base, False)  # the target's glue not fused: nor the head's
        head = loading.load_head(ckpt, model, "bfloat16").head
        assert not head.glue_fused and "glue" not in loading.speed_tag(head)
        fuse_glue(base, True)
        head = loading.load_head(ckpt, model, "bfloat16").head
        assert head.glue_fused and loading.speed_tag(head).endswith(" glue")  # its latencies measured again
        assert "draft head: norms, residual sum and rotary embedding fused" in capsys.readouterr().err
        assert not loading.load_head(ckpt, model, "float32").head.glue_fused  # the kernels are bfloat16's
        monkeypatch.setattr(loading, "_head_glue_same", lambda h: False)  # other bits: kept unfused
        assert not loading.load_head(ckpt, model, "bfloat16").head.glue_fused
    finally:
        fuse_glue(base, False)


def test_the_head_glue_probe_compares_every_output():
    cfg = Eagle3Config(vocab_size=64, hidden_size=64, intermediate_size=64, num_attention_heads=4,
                       num_key_value_heads=2)
    head = Eagle3Head(cfg).to(torch.bfloat16).eval()
    assert loading._head_glue_same(head) and not head.glue_fused  # the same bits; the flag as it was
    real = head.draft_logits
    head.draft_logits = lambda h: real(h) + (1 if head.glue_fused else 0)  # one output differs when fused
    assert not loading._head_glue_same(head)


def test_the_glue_probe_times_both_forwards_and_compares_their_bits():
    from rheoplan.kernels.decoder_glue import cpu
    from rheoplan.models.lean_llama import glue_fused
    from rheoplan.probe import GLUE_PROBES, glue_timings

    if not cpu.norm_applies():
        pytest.skip("torch's summation order not found on this CPU")
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2)).eval().to(torch.bfloat16)
    unfused, fused, same = glue_timings(model, reps=2)
    assert len(unfused) == len(fused) == len(GLUE_PROBES) and min(unfused + fused) > 0
    assert same and not glue_fused(model.model)


class _Tok:
    """A tokenizer without a chat template: characters to ids of a 32-token vocabulary."""

    chat_template = None

    def __call__(self, text):
        return {"input_ids": [ord(c) % 32 for c in text]}


@pytest.mark.parametrize("rows", [0, -1, 1.0])
def test_warm_up_refuses_rows_out_of_range(rows):
    with pytest.raises(ValueError, match="rows="):
        loading.warm_up(None, _Tok(), None, sampling=SamplingConfig(), tree=TreeConfig(), rows=rows)


@pytest.mark.parametrize("rows", [1, 3])
def test_warm_up_decodes_and_leaves_later_decodes_as_they_were(rows, monkeypatch):
    """The warm-up decodes WARM_UP_TOKENS tokens per row (one row, or ``rows`` through the
    batched stream), and a decode after it gives the tokens it gives without one."""
    from _decode_models import tiny_llama

    target = tiny_llama(2, vocab=32, hidden=32, layers=2, head_scale=20.0)
    draft = tiny_llama(3, vocab=32, hidden=32, layers=1, head_scale=20.0)
    sampling, tree = SamplingConfig(temperature=1.0), TreeConfig(depth=2, budget=4)
    before = plan_and_decode(target, draft, [1, 2, 3], max_new_tokens=8, sampling=sampling, tree=tree, seed=4).tokens
    made = []
    real = loading.plan_and_decode
    monkeypatch.setattr(loading, "plan_and_decode", lambda *a, **k: made.append(k["max_new_tokens"]) or real(*a, **k))
    streamed = []
    real_stream = loading.decode_requests

    def stream(*a, **k):
        for i, r in real_stream(*a, **k):
            streamed.append(len(r.tokens))
            yield i, r
    monkeypatch.setattr(loading, "decode_requests", stream)
    sec = loading.warm_up(target, _Tok(), draft, sampling=sampling, tree=tree, rows=rows)
    assert sec > 0
    assert (made, streamed) == (([loading.WARM_UP_TOKENS], []) if rows == 1 else ([], [loading.WARM_UP_TOKENS] * rows))
    after = plan_and_decode(target, draft, [1, 2, 3], max_new_tokens=8, sampling=sampling, tree=tree, seed=4).tokens
    assert after == before


def _curve(*ms):
    from rheoplan.costmodel import Timings
    sizes = (1, 8, 16, 32, 64)
    return Timings(sizes, ms, tuple(1.05 * m for m in ms), 64, 512, (1,), (2.0,), 5.0, 3.0)


#: the 2-core Zen 4 EPYC's record (bfloat16, ctx 64) and a flat one, as a GPU's for a small target
CPU_CURVE = _curve(23.5, 24.9, 31.7, 46.1, 75.4)
FLAT_CURVE = _curve(10.0, 10.0, 10.2, 10.5, 11.0)
DEFAULT_TREE = loading.auto_tree(TreeConfig(frontier=3, slots=3, rheostat=1, verifier="rheo"), "auto", "auto")


def test_large_tree_note_where_the_verify_price_is_flat_and_the_caps_bind():
    note = loading.large_tree_note(FLAT_CURVE, DEFAULT_TREE)
    assert note is not None and "64-token verify forward costs 1.10x" in note
    assert "--frontier 12 --slots 12 --budget 128" in note and "the 32 nodes (3 expanded a depth" in note


@pytest.mark.parametrize("curve, tree", [
    (CPU_CURVE, DEFAULT_TREE),  # the price grows: the default caps are what pays
    (_curve(10.0, 10.5, 11.0, 11.8, 12.6), DEFAULT_TREE),  # 1.26x: just past flat
    (FLAT_CURVE, DEFAULT_TREE.with_(frontier=12, slots=12, budget=128)),  # already as large
    (FLAT_CURVE, TreeConfig.chain(depth=6)),  # a chain has no width to widen
])
def test_no_large_tree_note_where_the_price_grows_or_the_caps_are_large(curve, tree):
    assert loading.large_tree_note(curve, tree) is None


@pytest.mark.parametrize("frontier, slots, budget", [(3, 3, 128), (12, 3, 128), (3, 12, 128), (12, 12, 32)])
def test_large_tree_note_where_any_one_cap_binds(frontier, slots, budget):
    tree = DEFAULT_TREE.with_(frontier=frontier, slots=slots, budget=budget)
    assert loading.large_tree_note(FLAT_CURVE, tree) is not None
