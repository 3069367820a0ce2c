"""The sampling job: shard order, follow-ups built from earlier shards, resume after a kill."""

from __future__ import annotations

import io
import os

import numpy as np
import pytest

from rheoplan.train import generate as gen
from rheoplan.train import prompts as pr
from rheoplan.train import tokens as tk

HELD = ["Why does ice float on water?", "What is 35% of 180?", "Name a planet."]


def _jobs(tok, d, n=13, batch=3):
    plan = pr.build_plan(seed=0, n_generated=n, heldout=HELD)
    return plan, gen.plan_jobs(plan, HELD, tok, d, batch_size=batch, max_new_tokens=6, heldout_tokens=4,
                               temperature=1.0, heldout_temperature=1.0, seed=0, heldout_batch_size=2)


def _run(model, tok, jobs, d, **kw):
    return gen.run_jobs(model, tok, jobs, d, seed=0, vocab_size=100, eos_id=2, dtype_name="float32",
                        log=io.StringIO(), **kw)


def test_job_order_heldout_first_then_follow_ups_after_every_group(tiny_tokenizer, tmp_path):
    plan, jobs = _jobs(tiny_tokenizer, str(tmp_path))
    names = [j.name for j in jobs]
    assert names[:2] == ["heldout_00000", "heldout_00001"]  # 3 held-out prompts, 2 per shard
    assert names[2:] == ["train_r1_00000", "train_r1_00001", "train_r1_00002", "train_r1_00003", "train_fu_00000",
                         "train_r1_00004", "train_fu_00001"]  # 13 prompts, 3 per shard
    ids = [pid for j in jobs if j.name.startswith("train_r1") for pid, _ in j.prompts()]
    assert sorted(ids) == [p.id for p in plan]  # every planned prompt once
    held = [pid for j in jobs if j.name.startswith("heldout") for pid, _ in j.prompts()]
    assert held == [0, 1, 2]


@pytest.mark.slow
def test_run_writes_follow_ups_of_the_targets_own_answers(tiny_target, tiny_tokenizer, tmp_path):
    d = str(tmp_path)
    plan, jobs = _jobs(tiny_tokenizer, d, n=24, batch=4)
    _run(tiny_target, tiny_tokenizer, jobs, d)
    firsts = {r["prompt_id"]: r for n in tk.list_shards(d, "train_r1") for r in tk.read_shard(d, n)[1]}
    fus = [r for n in tk.list_shards(d, "train_fu") for r in tk.read_shard(d, n)[1]]
    assert len(firsts) == len(plan)
    assert {r["prompt_id"] - pr.FOLLOWUP_BASE for r in fus} == {i for i in firsts if pr.has_follow_up(i)}
    for r in fus:
        parent = firsts[r["prompt_id"] - pr.FOLLOWUP_BASE]
        text = tiny_tokenizer.decode(r["tokens"][:r["prompt_len"]].tolist())
        answer = tiny_tokenizer.decode(parent["tokens"][parent["prompt_len"]:].tolist(), skip_special_tokens=True)
        # user turn, the target's own answer, the follow-up turn, then the new answer
        assert text.count("<|im_start|>user") == 2 and answer in text
        assert text.endswith(pr.follow_up(parent["prompt_id"]) + "<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.slow
def test_a_killed_job_resumes_to_the_same_shards(tiny_target, tiny_tokenizer, tmp_path):
    """A run killed after 3 shards and resumed writes the shards of an uninterrupted run,
    which here also ran another schedule (3 live rows instead of 64): every row draws from
    its own (seed, shard, row) stream (float32, so rounding does not differ either)."""
    full, part = str(tmp_path / "full"), str(tmp_path / "part")
    _run(tiny_target, tiny_tokenizer, _jobs(tiny_tokenizer, full)[1], full, live_rows=3)
    out = _run(tiny_target, tiny_tokenizer, _jobs(tiny_tokenizer, part)[1], part, max_shards=3)  # the "kill"
    assert out["new_shards"] == 3 and len([f for f in os.listdir(part) if f.endswith(".json")]) == 3
    log = io.StringIO()
    gen.run_jobs(tiny_target, tiny_tokenizer, _jobs(tiny_tokenizer, part)[1], part, seed=0, vocab_size=100,
                 eos_id=2, dtype_name="float32", log=log)
    assert "3 present" in log.getvalue() and "tok/s" in log.getvalue() and "ETA" in log.getvalue()
    assert " min " in log.getvalue().splitlines()[-1]  # the recent rate beside the run's
    assert sorted(os.listdir(full)) == sorted(os.listdir(part))
    for f in os.listdir(full):
        if f.endswith(".npy"):
            assert np.array_equal(np.load(os.path.join(full, f)), np.load(os.path.join(part, f))), f
    ix = tk.read_shard(full, "train_r1_00001")[0]
    assert ix["rng"] == "row" and ix["row_seeds"] == [gen.row_seed(0, "train_r1_00001", r) for r in range(ix["rows"])]


def test_a_tokenizer_without_chat_template_is_rejected(tiny_tokenizer):
    class NoTemplate:
        chat_template = None

    with pytest.raises(ValueError, match="chat template"):
        gen.chat_ids(NoTemplate(), [{"role": "user", "content": "hi"}])


def test_more_prompts_get_shards_of_their_own_after_the_plan_and_only_append(tiny_tokenizer, tmp_path):
    every = pr.build_plan(seed=0, n_generated=13 + 24, heldout=HELD)  # prefix-stable in n_generated
    plan, more = every[:13], every[13:]
    assert plan == pr.build_plan(seed=0, n_generated=13, heldout=HELD)

    def jobs(extra):
        return gen.plan_jobs(plan, HELD, tiny_tokenizer, str(tmp_path), batch_size=3, max_new_tokens=6,
                             heldout_tokens=4, temperature=1.0, heldout_temperature=1.0, seed=0,
                             heldout_batch_size=2, more=extra)

    base = [j.name for j in jobs([])]
    grown = jobs(more)
    names = [j.name for j in grown]
    assert names[:len(base)] == base  # the plan's shards are untouched
    assert names[len(base):] == ["train_x_r1_00000", "train_x_r1_00001", "train_x_r1_00002", "train_x_r1_00003",
                                 "train_x_fu_00000", "train_x_r1_00004", "train_x_r1_00005",
                                 "train_x_r1_00006", "train_x_r1_00007", "train_x_fu_00001"]
    ids = [pid for j in grown if j.name.startswith("train_x_r1") for pid, _ in j.prompts()]
    assert ids == [p.id for p in more]  # in the generator's order: a longer extension appends
    half = [(j.name, [pid for pid, _ in j.prompts()]) for j in jobs(more[:12]) if j.name.startswith("train_x_r1")]
    full = [(j.name, [pid for pid, _ in j.prompts()]) for j in grown if j.name.startswith("train_x_r1")]
    assert full[:len(half)] == half
    assert [j.parents for j in grown if j.name == "train_x_fu_00000"] == [tuple(names[len(base):][:4])]

