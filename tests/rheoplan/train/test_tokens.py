"""Token shards and the batched sampler: padding invariance, EOS handling, row dropping,
compact atomic shards, resumable data-set records."""

from __future__ import annotations

import functools
import json
import os

import numpy as np
import pytest
import torch

from rheoplan.train import tokens as tk

PROMPTS = [[1, 5, 6, 7], [1, 9], [1, 4, 4, 4, 4, 4, 8], [1, 30, 31]]


def test_batched_greedy_equals_one_row_at_a_time(tiny_target):
    """Left padding, position ids and dropping finished rows leave each row's tokens as if
    it were sampled alone (greedy, float32)."""
    batch = tk.sample_tokens(tiny_target, PROMPTS, max_new_tokens=10, temperature=0, eos_id=0)
    for p, r in zip(PROMPTS, batch):
        alone = tk.sample_tokens(tiny_target, [p], max_new_tokens=10, temperature=0, eos_id=0)[0]
        assert r == alone
        assert r["tokens"][:len(p)] == p and r["prompt_len"] == len(p)


def test_greedy_tokens_are_the_argmax_and_eos_ends_a_row(tiny_target):
    """Each sampled token is the argmax of a full forward over what precedes it; a row that
    samples EOS stops there (EOS not stored) and leaves the others running."""
    # Make EOS the argmax after a specific context, by choosing it from a greedy run.
    ref = tk.sample_tokens(tiny_target, PROMPTS, max_new_tokens=8, temperature=0, eos_id=-1, pad_id=0)
    for r in ref:
        with torch.no_grad():
            logits = tiny_target(torch.tensor([r["tokens"]])).logits[0]
        P = r["prompt_len"]
        assert r["tokens"][P:] == logits[P - 1:-1].argmax(-1).tolist()
    eos = ref[0]["tokens"][ref[0]["prompt_len"] + 2]  # row 0's third sampled token
    rows = tk.sample_tokens(tiny_target, PROMPTS, max_new_tokens=8, temperature=0, eos_id=eos)
    assert rows[0]["stopped"]
    for r, full in zip(rows, ref):
        gen = full["tokens"][full["prompt_len"]:]
        k = gen.index(eos) if eos in gen else len(gen)
        assert r["tokens"] == full["tokens"][:full["prompt_len"] + k] and r["stopped"] == (eos in gen)


def test_a_model_that_always_says_eos_gives_prompt_only_rows():
    from transformers import LlamaConfig, LlamaForCausalLM

    m = LlamaForCausalLM(LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=4,
                                     num_attention_heads=2, num_key_value_heads=1, vocab_size=20)).eval()
    with torch.no_grad():
        m.lm_head.weight.zero_()  # all logits equal: the argmax is id 0 = EOS
    rows = tk.sample_tokens(m, [[3, 4], [5, 6, 7]], max_new_tokens=5, temperature=0, eos_id=0)
    assert [(r["tokens"], r["stopped"]) for r in rows] == [([3, 4], True), ([5, 6, 7], True)]


def test_sampling_is_reproducible_and_uses_the_generator(tiny_target):
    a = tk.sample_tokens(tiny_target, PROMPTS, max_new_tokens=12, temperature=1.0, eos_id=0,
                         generator=torch.Generator().manual_seed(3))
    b = tk.sample_tokens(tiny_target, PROMPTS, max_new_tokens=12, temperature=1.0, eos_id=0,
                         generator=torch.Generator().manual_seed(3))
    c = tk.sample_tokens(tiny_target, PROMPTS, max_new_tokens=12, temperature=1.0, eos_id=0,
                         generator=torch.Generator().manual_seed(4))
    assert a == b and a != c


# Prompts of very different lengths and caps, so rows finish at different steps and joiners
# are both shorter and longer than the running cache.
REFILL_PROMPTS = [[1, 5, 6, 7], [1, 9], [1, 4, 4, 4, 4, 4, 8, 3, 3, 3, 3, 3, 3, 3, 3, 7], [1, 30, 31],
                  [1, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30], [1, 2],
                  [1, 40, 41, 42, 43], [1, 50]]
REFILL_CAPS = [3, 12, 5, 9, 2, 14, 7, 1]


@pytest.fixture(scope="module")
def sharp_target():
    """The tiny Llama with larger weights (init std 0.2): its attention is peaked enough that
    a wrong position id or an unmasked pad column changes sampled tokens (the default tiny
    target's near-uniform attention hides both)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=100,
                                        initializer_range=0.2)).eval()


def _refill(model, live_rows, temperature, eos_id=0, order=None, refill_min=1):
    """Every REFILL_PROMPTS row through sample_refill with ``live_rows`` live rows; row r
    draws from a stream seeded with 100 + r. Returns rows by index and the mask widths seen."""
    order = list(range(len(REFILL_PROMPTS))) if order is None else order
    queue = [tk.Request(r, REFILL_PROMPTS[r], REFILL_CAPS[r], temperature, tk.row_generator(100 + r)) for r in order]
    widths = []
    fwd = model.forward

    @functools.wraps(fwd)  # keeps the signature the sampler inspects
    def spy(*a, **kw):
        widths.append(kw["attention_mask"].shape)
        return fwd(*a, **kw)

    def feed(n):
        out = queue[:n]
        del queue[:n]
        return out

    model.forward = spy
    try:
        out = {req.key: row for req, row in tk.sample_refill(model, feed, live_rows=live_rows, eos_id=eos_id,
                                                             refill_min=refill_min)}
    finally:
        del model.forward
    for row in out.values():
        assert row.pop("wall_s") >= 0
    return out, widths


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_refill_rows_equal_each_row_sampled_alone(sharp_target, temperature):
    """Continuous refill (rows leave, waiting rows join a running batch of any cache length)
    gives every row the tokens it gets alone from the same stream: float32 greedy, and T = 1
    with per-row generators (the draws do not depend on the schedule)."""
    alone = {r: _refill(sharp_target, 1, temperature, order=[r])[0][r] for r in range(len(REFILL_PROMPTS))}
    assert any(len(a["tokens"]) - a["prompt_len"] > 1 for a in alone.values())
    for live in (2, 3, 8):
        got, widths = _refill(sharp_target, live, temperature)
        assert got == alone, live
        assert max(w[0] for w in widths) == live
    # another schedule (rows arriving in reverse order) still gives the same rows
    assert _refill(sharp_target, 3, temperature, order=list(range(len(REFILL_PROMPTS)))[::-1])[0] == alone
    # finished rows kept in the batch (fed pads) until 3 of them can be dropped at once
    got, widths = _refill(sharp_target, 5, temperature, refill_min=3)
    assert got == alone


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_each_draw_follows_the_rows_softmax(temperature):
    """The sampler's draw (inverse CDF with a uniform from the row's own stream) is the
    categorical softmax(logits / T): chi-square over 20000 rows, each with its own stream.
    Fails for a draw that ignores T (checked: 0.6 rejects softmax(logits))."""
    from scipy.stats import chisquare

    logits = torch.tensor([2.0, 0.5, -1.0, 1.0, 0.0, -30.0])
    n = 20000
    rows = [{"req": tk.Request(i, [1], 1, temperature, tk.row_generator(i))} for i in range(n)]
    got = torch.bincount(torch.tensor(tk._draw(logits.expand(n, -1), rows)), minlength=6)
    p = torch.softmax(logits / temperature, -1).double()
    assert got[5] == 0
    assert chisquare(got[:5].double().numpy(), (p[:5] / p[:5].sum() * n).numpy()).pvalue > 1e-4


def test_refill_drops_columns_no_live_row_needs(tiny_target):
    """The cache does not keep the length of rows that left: after the long prompt (row 4,
    cap 2) finishes, later decode steps attend over fewer columns than it needed."""
    _, widths = _refill(tiny_target, 3, 0.0)
    peak = max(range(len(widths)), key=lambda i: widths[i][1])
    assert min(w[1] for w in widths[peak:]) < widths[peak][1] - 5


def test_refill_rejects_bad_settings(tiny_target):
    with pytest.raises(ValueError, match="live_rows"):
        next(tk.sample_refill(tiny_target, lambda n: [], live_rows=0, eos_id=0))
    with pytest.raises(ValueError, match="refill_min"):
        next(tk.sample_refill(tiny_target, lambda n: [], live_rows=4, eos_id=0, refill_min=5))
    with pytest.raises(ValueError, match="max_new_tokens"):
        tk.Request(0, [1], 0, 1.0)
    with pytest.raises(ValueError, match="prompt"):
        tk.Request(0, [], 3, 1.0)


@pytest.mark.parametrize("kw, msg", [
    (dict(prompts=[]), "prompts"), (dict(prompts=[[1], []]), "prompts"),
    (dict(temperature=-1.0), "temperature"), (dict(max_new_tokens=0), "max_new_tokens"),
])
def test_sampler_rejects_bad_input(tiny_target, kw, msg):
    args = dict(prompts=[[1, 2]], max_new_tokens=2, temperature=1.0, eos_id=0) | kw
    with pytest.raises(ValueError, match=msg):
        tk.sample_tokens(tiny_target, **args)


def _rows():
    return [{"tokens": [1, 2, 3, 40000], "prompt_len": 2, "prompt_id": 7, "stopped": True},
            {"tokens": [1, 5], "prompt_len": 1, "prompt_id": 1_000_003, "stopped": False}]


def test_shard_round_trip_is_uint16_and_atomic(tmp_path):
    d = str(tmp_path)
    assert not tk.shard_done(d, "train_r1_00000")
    tk.write_shard(d, "train_r1_00000", _rows(), vocab_size=49152, temperature=1.0, seed=11)
    assert tk.shard_done(d, "train_r1_00000")
    assert sorted(os.listdir(d)) == ["train_r1_00000.json", "train_r1_00000.npy"]  # no temporaries left
    arr = np.load(os.path.join(d, "train_r1_00000.npy"))
    assert arr.dtype == np.uint16 and arr.nbytes == 2 * 6
    index, rows = tk.read_shard(d, "train_r1_00000")
    assert index["offsets"] == [0, 4, 6] and index["seed"] == 11 and index["token_dtype"] == "uint16"
    assert [r["tokens"].tolist() for r in rows] == [[1, 2, 3, 40000], [1, 5]]
    assert [(r["prompt_len"], r["prompt_id"], r["stopped"]) for r in rows] == [(2, 7, True), (1, 1_000_003, False)]
    assert tk.list_shards(d, "train") == ["train_r1_00000"] and tk.list_shards(d, "heldout") == []
    st = tk.dataset_stats(d)["train_r1"]
    assert (st["rows"], st["tokens"], st["sampled_tokens"]) == (2, 6, 3)


def test_shard_rejects_ids_outside_the_vocabulary_and_large_vocabularies_use_uint32(tmp_path):
    with pytest.raises(ValueError, match="token ids outside"):
        tk.write_shard(str(tmp_path), "x_0", _rows(), vocab_size=1000)
    assert tk.token_dtype(65536) == np.uint16 and tk.token_dtype(65537) == np.uint32
    tk.write_shard(str(tmp_path), "big_0", [{"tokens": [70000], "prompt_len": 1, "prompt_id": 0, "stopped": False}],
                   vocab_size=100000, temperature=1.0)
    assert tk.read_shard(str(tmp_path), "big_0")[1][0]["tokens"].tolist() == [70000]


def test_a_half_written_shard_does_not_count(tmp_path):
    """Tokens written but no index (a kill between the two writes): not done, rewritten later."""
    d = str(tmp_path)
    tk.write_shard(d, "train_r1_00000", _rows(), vocab_size=49152, temperature=1.0)
    os.remove(os.path.join(d, "train_r1_00000.json"))
    assert not tk.shard_done(d, "train_r1_00000") and tk.list_shards(d, "train") == []


def test_inconsistent_shard_is_reported(tmp_path):
    d = str(tmp_path)
    tk.write_shard(d, "train_r1_00000", _rows(), vocab_size=49152, temperature=1.0)
    path = os.path.join(d, "train_r1_00000.json")
    ix = json.load(open(path))
    ix["offsets"][-1] = 99
    json.dump(ix, open(path, "w"))
    with pytest.raises(ValueError, match="inconsistent"):
        tk.read_shard(d, "train_r1_00000")


def test_dataset_record_refuses_other_settings(tmp_path):
    d = str(tmp_path / "tok")
    tk.check_dataset(d, {"a": 1, "target": {"name": "x"}})
    tk.check_dataset(d, {"a": 1, "target": {"name": "x"}})  # same: fine
    with pytest.raises(SystemExit, match="other settings"):
        tk.check_dataset(d, {"a": 2, "target": {"name": "x"}})


def test_dataset_record_grows_only_where_the_caller_allows_it(tmp_path):
    d = str(tmp_path / "tok")
    base = {"a": 1}
    tk.check_dataset(d, base)
    seen = []

    def grows(old):
        seen.append(old)
        return None

    tk.check_dataset(d, {**base, "more": {"prompts": 4}}, grows=grows)  # an extension appears
    assert seen == [None]
    tk.check_dataset(d, {**base, "more": {"prompts": 8}}, grows=grows)  # and grows: recorded
    assert seen[-1] == {"prompts": 4}
    with open(os.path.join(d, "dataset.json")) as f:
        assert json.load(f)["more"] == {"prompts": 8}
    with pytest.raises(SystemExit, match="allowed 8 or more"):
        tk.check_dataset(d, base, grows=lambda old: "allowed 8 or more")
    with pytest.raises(SystemExit, match="other settings"):  # without a grows rule: a different record
        tk.check_dataset(d, {**base, "more": {"prompts": 12}})
    with pytest.raises(SystemExit, match="other settings"):  # growth never excuses another setting
        tk.check_dataset(d, {"a": 2, "more": {"prompts": 12}}, grows=grows)
