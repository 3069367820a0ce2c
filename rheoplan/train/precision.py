"""The draft head's training precision, chosen by measurement: bfloat16 autocast or float32.

Why measure: what a training step costs in each precision depends on the CPU far more
than its flags suggest. On the 2-core AVX2-only AMD EPYC (Zen 3, no AVX-512, no AMX;
2026-12-06) a step of the shipped head's shape (1,024 pairs, the training-time test's 2
steps) ran at 34-35 pairs/s in bfloat16 autocast and at 880-950 in float32, about 25 times faster:
torch's bfloat16 products there have no native instructions to run on. On the Zen 5 AMD
EPYC (AVX-512 with bf16), where the shipped head was trained in bfloat16 autocast, its
later epochs (the head's steps over cached features) ran at 2,290-2,560 pairs/s
(docs/train.md). Float32 is the more precise of the two, so the faster one is all there
is to choose.

``step_seconds`` times ``train.train_step`` on a copy of the head (the head itself does
not change) over synthetic pairs of the real shapes, each precision in turn after a
warm-up step; ``choose`` keeps the faster one, cached per machine, torch version, thread
count and head shape (``RHEOPLAN_REMEASURE=1`` measures again). ``rheoplan train-draft
--head-precision auto`` (the default) calls it.
"""

from __future__ import annotations

import copy
import time
from dataclasses import replace

import torch

from rheoplan.costmodel import cache_key, cache_read, cache_write, remeasure_requested
from rheoplan.models.eagle3 import Eagle3Head
from rheoplan.train import train as tr

#: the precisions a head trains in, by name: ``TrainConfig.autocast_bf16`` for each
PRECISIONS = {"bf16": True, "fp32": False}
#: pairs in a timed step: enough for the products to dominate, few enough that a slow
#: precision (35 pairs/s) costs seconds, not minutes
TIMED_PAIRS = 256
#: timed steps of each precision (alternating, after one warm-up step each)
TIMED_ROUNDS = 2
#: ``choose``'s cache file (under ``rheoplan.costmodel.cache_dir()``)
CACHE = "head_precision.json"


def synthetic_batch(head: Eagle3Head, vocab_size: int, pairs: int = TIMED_PAIRS, rows: int = 2,
                    topk: int = 32, seed: int = 0) -> tr.Batch:
    """A packed batch of ``pairs`` pairs in ``rows`` rows with random tokens, features and
    soft targets: the shapes a training step multiplies, not its data."""
    if pairs < rows or rows < 1:
        raise ValueError(f"pairs={pairs}, rows={rows}: allowed 1 <= rows <= pairs")
    g = torch.Generator().manual_seed(seed)
    width = head.fc.in_features
    sizes = [pairs // rows + (r < pairs % rows) for r in range(rows)]
    exs = [tr.Example(tokens=torch.randint(0, vocab_size, (n,), generator=g),
                      feats=torch.randn(n, width, generator=g),
                      topk_ids=torch.randint(0, vocab_size, (n, topk), generator=g),
                      topk_logp=torch.log_softmax(torch.randn(n, topk, generator=g), -1),
                      weight=torch.ones(n), response=torch.ones(n, dtype=torch.bool)) for n in sizes]
    return tr.collate(exs)


def step_seconds(head: Eagle3Head, embed: torch.Tensor, cfg: tr.TrainConfig, *, pairs: int = TIMED_PAIRS,
                 rounds: int = TIMED_ROUNDS) -> dict[str, float]:
    """Seconds of one ``train.train_step`` of ``pairs`` pairs in each of ``PRECISIONS``
    (the fastest of ``rounds`` timed steps, the precisions alternating after a warm-up step
    each), on a copy of ``head`` with its own optimiser: ``head`` is left as it was."""
    if rounds < 1:
        raise ValueError(f"rounds={rounds}: allowed >= 1")
    batch = synthetic_batch(head, int(embed.shape[0]), pairs)
    t2d_index = tr.target_to_draft_index(head.target_ids().cpu(), int(embed.shape[0]))
    runs = {}
    for name, autocast in PRECISIONS.items():
        h = copy.deepcopy(head).float().train()
        c = replace(cfg, autocast_bf16=autocast)
        opt = tr.make_optimizer(h, c)
        tr.train_step(h, embed, opt, batch, c, t2d_index)  # warm-up: first-call costs, optimiser state
        runs[name] = (h, c, opt)
    best = {name: float("inf") for name in PRECISIONS}
    for _ in range(rounds):
        for name, (h, c, opt) in runs.items():
            t = time.perf_counter()
            tr.train_step(h, embed, opt, batch, c, t2d_index)
            best[name] = min(best[name], time.perf_counter() - t)
    return best


def _key(head: Eagle3Head, cfg: tr.TrainConfig) -> str:
    c = head.config
    shape = (f"eagle3 hidden {c.hidden_size} mlp {c.intermediate_size} heads {c.num_attention_heads}/"
             f"{c.num_key_value_heads} draft vocab {c.draft_vocab_size} features {head.fc.in_features}")
    return cache_key("head_precision", shape, "cpu", ttt_steps=cfg.ttt_steps, pairs=TIMED_PAIRS)


def choose(head: Eagle3Head, embed: torch.Tensor, cfg: tr.TrainConfig) -> dict:
    """``{"precision": "bf16" | "fp32", "step_s": {precision: seconds}, "pairs": TIMED_PAIRS,
    "cached": bool}``: the faster precision for training ``head`` on this machine, measured
    by ``step_seconds`` or read from the cache."""
    key = _key(head, cfg)
    rec = None if remeasure_requested() else cache_read(CACHE, key)
    if (rec is not None and rec.get("precision") in PRECISIONS and isinstance(rec.get("step_s"), dict)
            and set(rec["step_s"]) == set(PRECISIONS)):
        return {**rec, "cached": True}
    times = step_seconds(head, embed, cfg)
    rec = {"precision": min(times, key=times.get), "step_s": times, "pairs": TIMED_PAIRS}
    cache_write(CACHE, key, rec)
    return {**rec, "cached": False}
