"""Token shards and the batched sampler: padding invariance, EOS handling, row dropping,
compact atomic shards, resumable data-set records."""

from __future__ import annotations

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
