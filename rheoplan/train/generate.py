"""The sampling job: the prompt plan, sampled by the target, into token shards.

Order of work (deterministic in the seed, so a resumed job writes what an uninterrupted
one would have written):

1. ``heldout_00000...``: the held-out evaluation prompts (``prompts_heldout.txt``), for
   the numbers in the model card; never trained on.
2. first turns, ``train_r1_NNNNN``: the plan (``rheoplan.train.prompts.build_plan``)
   shuffled and cut into batches of ``batch_size`` rows, one shard per batch;
3. after every ``FOLLOWUP_GROUP`` first-turn shards, one follow-up shard
   ``train_fu_NNNNN``: the rows of those shards chosen by ``prompts.has_follow_up``,
   continued as a conversation (first prompt, the target's own answer, a follow-up user
   turn from ``prompts.follow_up``) and sampled again.

Each shard's sampler is seeded from ``(seed, shard name)``. Shards already present are
skipped (``tokens.shard_done``), so ``rheoplan train-draft --stages generate`` picks up
after a kill. Progress (tokens done of the plan's estimate, tokens/s, ETA) goes to
stdout, one line per shard.
"""

from __future__ import annotations

import random
import sys
import time
import zlib
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from rheoplan.train import prompts as pr
from rheoplan.train import tokens as tk

#: first-turn shards per follow-up shard
FOLLOWUP_GROUP = 4


@dataclass
class Job:
    """One shard to sample: its name and how to get its prompts (``prompt_id``, token ids)."""

    name: str
    temperature: float
    max_new_tokens: int
    prompts: Callable[[], list[tuple[int, list[int]]]]
    expected_rows: float  #: for the ETA (follow-up shards: the expected share of their parents)


def chat_ids(tokenizer, messages: Sequence[dict]) -> list[int]:
    """Token ids of a conversation under the tokenizer's chat template, ending with the
    assistant header (the target's turn). A clear error when there is no chat template."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the target's tokenizer has no chat template; train-draft samples answers to chat "
                         "prompts and needs one (tokenizer_config.json 'chat_template')")
    ids = tokenizer.apply_chat_template(list(messages), tokenize=True, add_generation_prompt=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def plan_jobs(plan: Sequence[pr.PromptSpec], heldout: Sequence[str], tokenizer, directory: str, *,
              batch_size: int, max_new_tokens: int, heldout_tokens: int, temperature: float,
              heldout_temperature: float, seed: int, heldout_batch_size: int = 40) -> list[Job]:
    """Every shard of the data set, in the order they are sampled."""
    if batch_size < 1 or heldout_batch_size < 1:
        raise ValueError(f"batch_size={batch_size}, heldout_batch_size={heldout_batch_size}: allowed >= 1")
    by_id = {p.id: p for p in plan}

    def first_turns(specs):
        return lambda: [(p.id, chat_ids(tokenizer, [{"role": "user", "content": p.text}])) for p in specs]

    def held(i0, texts):
        return lambda: [(i0 + i, chat_ids(tokenizer, [{"role": "user", "content": t}])) for i, t in enumerate(texts)]

    def follow_ups(parent_names):
        def make():
            out = []
            for n in parent_names:
                if not tk.shard_done(directory, n):
                    continue  # only when that shard's job was skipped by a partial run
                for row in tk.read_shard(directory, n)[1]:
                    pid = row["prompt_id"]
                    if not pr.has_follow_up(pid):
                        continue
                    answer = tokenizer.decode(row["tokens"][row["prompt_len"]:].tolist(), skip_special_tokens=True)
                    msgs = [{"role": "user", "content": by_id[pid].text},
                            {"role": "assistant", "content": answer},
                            {"role": "user", "content": pr.follow_up(pid)}]
                    out.append((pid + pr.FOLLOWUP_BASE, chat_ids(tokenizer, msgs)))
            return out
        return make

    jobs = []
    for b in range(0, len(heldout), heldout_batch_size):
        texts = list(heldout[b:b + heldout_batch_size])
        jobs.append(Job(f"heldout_{b // heldout_batch_size:05d}", heldout_temperature, heldout_tokens,
                        held(b, texts), len(texts)))
    order = list(plan)
    random.Random(seed).shuffle(order)
    r1 = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    group: list[str] = []
    n_group = 0
    for i, specs in enumerate(r1):
        name = f"train_r1_{i:05d}"
        jobs.append(Job(name, temperature, max_new_tokens, first_turns(specs), len(specs)))
        group.append(name)
        n_group += len(specs)
        if len(group) == FOLLOWUP_GROUP or i == len(r1) - 1:
            jobs.append(Job(f"train_fu_{i // FOLLOWUP_GROUP:05d}", temperature, max_new_tokens,
                            follow_ups(list(group)), n_group / pr.FOLLOWUP_EVERY))
            group, n_group = [], 0
    return jobs


def shard_seed(seed: int, name: str) -> int:
    return zlib.crc32(f"{seed}/{name}".encode())


def run_jobs(model: torch.nn.Module, tokenizer, jobs: Sequence[Job], directory: str, *, seed: int,
             vocab_size: int, eos_id: int, dtype_name: str, log=None, max_shards: int | None = None) -> dict:
    """Sample every job whose shard is missing; returns counts for this run.

    ``max_shards`` stops after that many new shards (tests, short sittings); ``log`` is a
    text stream for the progress lines (default stdout).
    """
    log = sys.stdout if log is None else log
    todo = [j for j in jobs if not tk.shard_done(directory, j.name)]
    n_first = sum(1 for j in jobs if j.name.startswith("train_r1_"))
    stats = tk.dataset_stats(directory)
    done_tok = sum(s["sampled_tokens"] for s in stats.values())
    done_rows = sum(s["rows"] for s in stats.values())
    print(f"[generate] {len(jobs)} shards planned ({n_first} first-turn), {len(jobs) - len(todo)} present "
          f"({done_rows} rows, {done_tok} sampled tokens), {len(todo)} to go; dtype {dtype_name}, "
          f"{torch.get_num_threads()} threads", file=log, flush=True)
    t_run, run_tok, new = time.time(), 0, 0
    for j in todo:
        if max_shards is not None and new >= max_shards:
            break
        items = j.prompts()
        if not items:
            continue
        t0 = time.time()
        g = torch.Generator().manual_seed(shard_seed(seed, j.name))
        rows = tk.sample_tokens(model, [ids for _, ids in items], max_new_tokens=j.max_new_tokens,
                                temperature=j.temperature, eos_id=eos_id, generator=g)
        for r, (pid, _) in zip(rows, items):
            r["prompt_id"] = pid
        wall = time.time() - t0
        tk.write_shard(directory, j.name, rows, vocab_size=vocab_size, temperature=j.temperature,
                       seed=shard_seed(seed, j.name), max_new_tokens=j.max_new_tokens, dtype=dtype_name,
                       wall_s=round(wall, 2))
        n = sum(len(r["tokens"]) - r["prompt_len"] for r in rows)
        run_tok += n
        done_tok += n
        done_rows += len(rows)
        new += 1
        rate = run_tok / max(time.time() - t_run, 1e-9)
        # What is left, from the mean sampled tokens per row so far.
        per_row = done_tok / max(done_rows, 1)
        rows_left = sum(x.expected_rows for x in todo if not tk.shard_done(directory, x.name))
        eta = rows_left * per_row / max(rate, 1e-9)
        print(f"[generate] {time.strftime('%H:%M:%S')} {j.name}: {len(rows)} rows, {n} tokens in {wall:.0f} s "
              f"({n / max(wall, 1e-9):.1f} tok/s) | total {done_tok} sampled tokens, {done_rows} rows | "
              f"run {rate:.1f} tok/s | about {rows_left * per_row / 1e6:.2f} M tokens left, ETA {eta / 3600:.1f} h",
              file=log, flush=True)
    return {"new_shards": new, "sampled_tokens": run_tok, "wall_s": time.time() - t_run}

