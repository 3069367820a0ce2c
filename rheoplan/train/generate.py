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
   turn from ``prompts.follow_up``) and sampled again;
4. prompts added to the plan later (``--more-prompts``): the same, in shards named
   ``train_x_r1_NNNNN`` / ``train_x_fu_NNNNN``, after every shard of the plan.

The rows of several shards are sampled together with continuous refill
(``tokens.sample_refill``); each row draws from its own stream seeded from
``(seed, shard name, row)`` (``row_seed``), so what a shard holds does not depend on the
schedule, and a shard is written when its last row finishes. Shards already present are
skipped (``tokens.shard_done``), so ``rheoplan train-draft --stages generate`` picks up
after a kill (rows of unfinished shards are resampled from their streams). Progress
(tokens done of the plan's estimate, tokens/s over the run and over the last ten minutes,
the ETA at the latter, ``RecentRate``) goes to stdout, one line per shard and at least one
a minute.

Shards written before the refill sampler (their index has no ``rng`` key) were sampled
32 rows in lockstep from one stream per shard (``shard_seed``); they hold samples of the
same law and stay valid, but today's code would draw other tokens for them.
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
from rheoplan.train.progress import RecentRate

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
    parents: tuple[str, ...] = ()  #: shards whose rows this job's prompts are built from


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
              heldout_temperature: float, seed: int, heldout_batch_size: int = 40,
              more: Sequence[pr.PromptSpec] = ()) -> list[Job]:
    """Every shard of the data set, in the order they are sampled.

    ``more``: prompts appended to the plan later (``--more-prompts``), sampled after every
    shard of ``plan`` into shards of their own (``train_x_r1_*``, ``train_x_fu_*``), in
    their own order (not shuffled: the generator's stream is already random), so a longer
    ``more`` only appends shards and leaves the earlier ones as they are.
    """
    if batch_size < 1 or heldout_batch_size < 1:
        raise ValueError(f"batch_size={batch_size}, heldout_batch_size={heldout_batch_size}: allowed >= 1")
    by_id = {p.id: p for p in [*plan, *more]}

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
    def turns(specs: list[pr.PromptSpec], prefix: str) -> None:
        # first-turn shards of ``batch_size`` rows, a follow-up shard after every
        # FOLLOWUP_GROUP of them (and after the last)
        r1 = [specs[i:i + batch_size] for i in range(0, len(specs), batch_size)]
        group: list[str] = []
        n_group = 0
        for i, batch in enumerate(r1):
            name = f"{prefix}_r1_{i:05d}"
            jobs.append(Job(name, temperature, max_new_tokens, first_turns(batch), len(batch)))
            group.append(name)
            n_group += len(batch)
            if len(group) == FOLLOWUP_GROUP or i == len(r1) - 1:
                jobs.append(Job(f"{prefix}_fu_{i // FOLLOWUP_GROUP:05d}", temperature, max_new_tokens,
                                follow_ups(list(group)), n_group / pr.FOLLOWUP_EVERY, tuple(group)))
                group, n_group = [], 0

    order = list(plan)
    random.Random(seed).shuffle(order)
    turns(order, "train")
    turns(list(more), "train_x")
    return jobs


def shard_seed(seed: int, name: str) -> int:
    return zlib.crc32(f"{seed}/{name}".encode())


def row_seed(seed: int, name: str, row: int) -> int:
    """The seed of row ``row`` of shard ``name``: each row samples from its own stream, so
    its tokens do not depend on which rows of which shards run beside it."""
    return shard_seed(seed, f"{name}/{row}")


#: the progress line's period when no shard finished (seconds)
PROGRESS_EVERY = 60.0


def run_jobs(model: torch.nn.Module, tokenizer, jobs: Sequence[Job], directory: str, *, seed: int,
             vocab_size: int, eos_id: int, dtype_name: str, log=None, max_shards: int | None = None,
             live_rows: int = 64) -> dict:
    """Sample every job whose shard is missing; returns counts for this run.

    Rows of several shards run together (``tokens.sample_refill``: up to ``live_rows``
    rows, finished rows replaced by waiting ones, the waiting rows taken in job order); a
    shard is written as soon as all its rows are done. Row ``r`` of shard ``name`` draws
    from its own stream (``row_seed``), so a shard does not depend on the schedule (which
    shards ran together, ``live_rows``, where a killed run stopped) beyond float rounding.
    A follow-up job starts once its parent shards are written.

    ``max_shards`` limits this run to the first that many missing shards (tests, short
    sittings); ``log`` is a text stream for the progress lines (default stdout).
    """
    log = sys.stdout if log is None else log
    todo = [j for j in jobs if not tk.shard_done(directory, j.name)]
    n_first = sum(1 for j in jobs if "_r1_" in j.name)
    stats = tk.dataset_stats(directory)
    done_tok = sum(s["sampled_tokens"] for s in stats.values())
    done_rows = sum(s["rows"] for s in stats.values())
    print(f"[generate] {len(jobs)} shards planned ({n_first} first-turn), {len(jobs) - len(todo)} present "
          f"({done_rows} rows, {done_tok} sampled tokens), {len(todo)} to go; dtype {dtype_name}, "
          f"{torch.get_num_threads()} threads, {live_rows} live rows", file=log, flush=True)
    run = todo if max_shards is None else todo[:max_shards]
    waiting = list(run)  # jobs not yet expanded into rows, in order
    in_run = {j.name for j in run}
    queue: list[tk.Request] = []
    open_jobs: dict[str, dict] = {}  # expanded, not yet written: rows by index, rows left
    t_run, run_tok, new = time.time(), 0, 0
    last_line = [time.time()]

    def ready(j: Job) -> bool:
        # parents of this run must be written first (their rows are this job's prompts)
        return all(tk.shard_done(directory, p) or p not in in_run for p in j.parents)

    def feed(n: int) -> list[tk.Request]:
        while len(queue) < n:
            j = next((x for x in waiting if ready(x)), None)
            if j is None:
                break
            waiting.remove(j)
            items = j.prompts()
            if not items:
                continue  # e.g. a follow-up shard none of whose parents' rows continue
            open_jobs[j.name] = {"job": j, "items": items, "rows": [None] * len(items), "left": len(items)}
            queue.extend(tk.Request((j.name, r), ids, j.max_new_tokens, j.temperature,
                                    tk.row_generator(row_seed(seed, j.name, r)))
                         for r, (_, ids) in enumerate(items))
        out = queue[:n]
        del queue[:n]
        return out

    sampler: dict = {}
    recent = RecentRate()
    recent.add(t_run, 0)

    def progress(extra: str) -> None:
        now = time.time()
        drawn = sampler.get("drawn", 0)  # every sampled token, rows still running included
        rate = drawn / max(now - t_run, 1e-9)
        recent.add(now, drawn)
        last = recent.rate()
        last = rate if last is None else last
        per_row = done_tok / max(done_rows, 1)  # what is left, from the mean tokens per row so far
        rows_left = sum(x.expected_rows for x in jobs if not tk.shard_done(directory, x.name))
        eta = f"{rows_left * per_row / last / 3600:.1f} h" if last > 0 else "unknown (no token in the last minutes)"
        print(f"[generate] {time.strftime('%H:%M:%S')} {extra} | total {done_tok} sampled tokens, {done_rows} rows | "
              f"run {rate:.1f} tok/s, last {recent.span() / 60:.0f} min {last:.1f} tok/s "
              f"({sampler.get('live', 0)} live rows, cache {sampler.get('width', 0)} columns) | "
              f"about {rows_left * per_row / 1e6:.2f} M tokens left, ETA {eta}",
              file=log, flush=True)
        last_line[0] = now

    for req, row in tk.sample_refill(model, feed, live_rows=live_rows, eos_id=eos_id, stats=sampler):
        name, r = req.key
        o = open_jobs[name]
        row["prompt_id"] = o["items"][r][0]
        o["rows"][r] = row
        o["left"] -= 1
        n_row = len(row["tokens"]) - row["prompt_len"]
        run_tok += n_row
        if o["left"]:
            if time.time() - last_line[0] > PROGRESS_EVERY:
                progress(f"{len(open_jobs)} shards open")
            continue
        j, rows = o["job"], o["rows"]
        del open_jobs[name]
        wall = sum(x.pop("wall_s") for x in rows)
        tk.write_shard(directory, name, rows, vocab_size=vocab_size, temperature=j.temperature,
                       seed=shard_seed(seed, name), rng="row", row_seeds=[row_seed(seed, name, i) for i in range(len(rows))],
                       max_new_tokens=j.max_new_tokens, dtype=dtype_name, wall_s=round(wall, 2), live_rows=live_rows)
        n = sum(len(x["tokens"]) - x["prompt_len"] for x in rows)
        done_tok += n
        done_rows += len(rows)
        new += 1
        progress(f"{name}: {len(rows)} rows, {n} tokens ({wall:.0f} s of sampler time)")
    return {"new_shards": new, "sampled_tokens": run_tok, "wall_s": time.time() - t_run}
