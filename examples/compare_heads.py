"""Two or more EAGLE-3 heads side by side on SmolLM2: decode speed and accepted length.

Every prompt runs transformers ``generate`` and then each (head, method) pair, one after
the other, before the next prompt starts (interleaved prompt by prompt, one process), so
a machine that slows down mid-run slows every column alike. Methods are those of
``rheoplan bench decode`` (``default`` = what ``rheoplan generate`` does: the cost model
plans every tree; ``eagle`` = EAGLE's one-hot top-K tree; ``rheo-m1-ot`` = RheoSampling
with the same fixed tree). Prints one table row per (head, method, temperature):
tokens/s, speed-up against ``generate`` over the same prompts, mean accepted length.

    python examples/compare_heads.py --heads auto /tmp/head_work/export --prompts 16 --tokens 64
    python examples/compare_heads.py --heads auto --draft-dtypes float32 bfloat16 --methods default rheo-m1-ot
    python examples/compare_heads.py --heads auto --priors head none --prompts 12

``--priors head none`` runs the cost model from each head's ``calibration.json`` (the
acceptance priors of ``rheoplan calibrate``, what ``rheoplan generate`` does) and from
no prior, side by side.

``auto`` is the shipped head (``rheoplan/assets/smollm2-eagle3``); any other value is a
directory written by ``rheoplan train-draft`` (or any EAGLE-3 checkpoint for SmolLM2).

Every head's cost model measures its own draft call and bookkeeping, but they all price
the target's verify forwards with one curve, the first head's: it is the same target, and
on a noisy machine two measurements of it can differ in shape by more than two heads
differ (one such comparison read 1.33x against 1.36x with a one-token forward timed at 34.0
ms for the first head and 29.6 ms for the second; docs/results.md, "Forwards timed as a
decode runs them"). ``--own-curves`` keeps each head's own measurement.
"""

from __future__ import annotations

import argparse
import os

import torch

from rheoplan.bench.decode import decode_prompt, load_prompts, methods_for
from rheoplan.costmodel import CostModel
from rheoplan.loading import (DRAFT_DTYPES, SHIPPED_HEAD, encode_prompt, load_cost_model, load_default, load_head,
                              model_dtype)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--heads", nargs="+", default=["auto"], help="'auto' (the shipped head) or head directories")
    p.add_argument("--methods", nargs="+", default=["default"], help="bench decode method names")
    p.add_argument("--prompts", type=int, default=16, help="held-out prompts (at most 40)")
    p.add_argument("--tokens", type=int, default=64, help="new tokens per prompt")
    p.add_argument("--temperatures", type=float, nargs="+", default=[1.0, 0.0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--draft-dtypes", nargs="+", default=["auto"], choices=list(DRAFT_DTYPES),
                   help="run each head in each of these dtypes (default auto, as rheoplan generate)")
    p.add_argument("--priors", nargs="+", default=["head"], choices=["head", "none"],
                   help="the cost model's starting calibration: the head's calibration.json "
                        "(default, as rheoplan generate) and/or none")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--own-curves", action="store_true",
                   help="each head's cost model keeps its own measurement of the target's verify curve "
                        "(default: all take the first head's)")
    a = p.parse_args()
    if not 1 <= a.prompts <= 40:
        p.error(f"--prompts={a.prompts}: allowed 1..40")
    if a.tokens < 1:
        p.error(f"--tokens={a.tokens}: allowed >= 1")
    for h in a.heads:
        if h != "auto" and not os.path.isdir(h):
            p.error(f"--heads: {h!r} is not a directory (allowed 'auto' or a head directory)")
    known = methods_for(4, 3, 3, 8)
    bad = [m for m in a.methods if m not in known or known[m].tree is None]
    if bad:
        p.error(f"--methods {bad}: allowed {sorted(k for k, m in known.items() if m.tree is not None)}")
    if a.threads:
        torch.set_num_threads(a.threads)

    model, tok, _ = load_default(method="autoregressive", dtype=a.dtype)
    heads = {}
    for h in a.heads:
        path = SHIPPED_HEAD if h == "auto" else h
        for dt in a.draft_dtypes:
            draft = load_head(path, model, dt)
            for prior in a.priors:
                costs = {m: load_cost_model(model, tok, draft, known[m].tree,
                                            draft_id=f"eagle3:{os.path.abspath(path)}",
                                            calibration=None if prior == "head" else "none")
                         for m in a.methods if known[m].cost}
                label = h if len(a.draft_dtypes) == 1 else f"{h} ({model_dtype(draft.head)}, asked {dt})"
                label += "" if len(a.priors) == 1 else f", prior {prior}"
                heads[label] = (draft, costs)
    if not a.own_curves:
        first = next(iter(heads.values()))[1]
        for label, (draft, costs) in heads.items():
            heads[label] = (draft, {m: shared_curve(cm, first[m]) for m, cm in costs.items()})
    prompts = [encode_prompt(tok, text, chat=True) for _, text in load_prompts(a.prompts)]
    cols = [("ar-hf", None)] + [(m, h) for h in heads for m in a.methods]
    seconds = {(m, h, t): 0.0 for m, h in cols for t in a.temperatures}
    tokens, steps = dict.fromkeys(seconds, 0), dict.fromkeys(seconds, 0)
    for j, ids in enumerate(prompts):
        for t in a.temperatures:
            seed = a.seed * 1000 + j
            for m, h in cols:
                draft, costs = heads[h] if h is not None else (None, {})
                n, k, sec, _ = decode_prompt(model, tok, draft, known[m], ids, t, seed, a.tokens,
                                             cost_model=costs.get(m))
                seconds[m, h, t] += sec
                tokens[m, h, t] += n
                steps[m, h, t] += k
        print(f"prompt {j + 1}/{len(prompts)} done", flush=True)
    print(f"\n{len(prompts)} held-out prompts x {a.tokens} tokens, seed {a.seed}, "
          f"{next(model.parameters()).dtype}, {torch.get_num_threads()} threads\n")
    print("| head | method | T | tok/s | vs generate | mean accepted length |")
    print("|---|---|---|---|---|---|")
    for t in a.temperatures:
        base = tokens["ar-hf", None, t] / seconds["ar-hf", None, t]
        for m, h in cols:
            rate = tokens[m, h, t] / seconds[m, h, t]
            print(f"| {h or '-'} | {m} | {t:g} | {rate:.1f} | {rate / base:.2f}x | "
                  f"{tokens[m, h, t] / max(steps[m, h, t], 1):.2f} |")


def shared_curve(cost: CostModel, ref: CostModel) -> CostModel:
    """``cost`` with ``ref``'s verify curve (the target's), its own draft and bookkeeping."""
    return CostModel(cost.timings.with_verify_of(ref.timings), cost.calibration, cost.priors)


if __name__ == "__main__":
    main()
