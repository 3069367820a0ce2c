"""How long the cost model's walks get where a verify forward of many tokens costs what a
one-token forward does (roughly a GPU's curve for a small target), against this machine's.

On a 2-core CPU a 64-token verify forward of SmolLM2 costs about 3x a one-token one, so the
cost model keeps about 7 drafted nodes a step and the mean accepted length at T = 1 is
about 2.1 (docs/results.md). This script asks what the same planner would keep, and what
the real target, head and walk would then accept, if the price of a tree did not grow with
its size: each configuration's cost model gets the verify curve of the first one (this
machine's, measured once), or that curve's one-token latency at every size up to
``flat``. Nothing else changes: the draft and the bookkeeping keep their measured
latencies, the tree shape is still chosen by the cost model's rule, and every decode is
the real one (only the price the planner reads is made up, so the tokens/s are this
machine's, not a flat machine's). Interleaved prompt by prompt, one process:

    python examples/flat_verify_trees.py --configs 6/3/3/32/0 6/3/3/32/64 6/12/12/128/128
    python examples/flat_verify_trees.py --configs 6/3/3/32/0 10/12/12/128/0 --temperature 0

A configuration is ``depth/frontier/slots/budget/flat``: the largest tree the cost model
may plan (``rheoplan generate --depth auto --frontier F --slots S --budget B`` plans up
to ``6/F/S/B``; the defaults are ``6/3/3/32``), and ``flat`` = 0 for the measured curve,
else the verify price made flat up to that many tokens. It prints, per configuration: the
mean accepted length (tokens a step), the cost model's prediction of it, drafted nodes kept
a step, the share of drafted steps that kept the whole budget (the cap bound the rule) and
tokens/s on this machine.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import replace

import torch

from rheoplan.bench.decode import Method, decode_prompt, load_prompts
from rheoplan.config import TreeConfig
from rheoplan.costmodel import CostModel
from rheoplan.loading import SHIPPED_HEAD, encode_prompt, load_cost_model, load_default, load_head

#: the verify sizes a flat curve is given (tokens, root included), up to its ``flat``
FLAT_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def parse_config(text: str) -> tuple[int, int, int, int, int]:
    """``'D/F/S/B/flat'`` -> five ints; a clear error for anything else."""
    parts = text.split("/")
    try:
        vals = tuple(int(x) for x in parts)
    except ValueError:
        vals = ()
    if len(vals) != 5 or min(vals[:4]) < 1 or vals[4] < 0:
        raise ValueError(f"--configs {text!r}: allowed 'depth/frontier/slots/budget/flat', four ints >= 1 "
                         "and flat >= 0 (0: the measured curve)")
    return vals  # type: ignore[return-value]


def priced(cost: CostModel, curve: CostModel, flat: int) -> CostModel:
    """``cost`` with ``curve``'s verify latencies (the target's), made flat up to ``flat``
    tokens at its one-token latency when ``flat`` > 0; its own draft and bookkeeping
    latencies and calibration kept."""
    t = cost.timings.with_verify_of(curve.timings)
    if flat:
        sizes = tuple(s for s in FLAT_SIZES if s <= flat) or (1,)
        t = replace(t, sizes=sizes, verify_lo=(t.verify_lo[0],) * len(sizes), verify_hi=(t.verify_hi[0],) * len(sizes))
    return CostModel(t, cost.calibration, cost.priors)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", nargs="+", required=True, help="depth/frontier/slots/budget/flat, one or more")
    p.add_argument("--prompts", type=int, default=40, help="held-out prompts (1..40)")
    p.add_argument("--tokens", type=int, default=64, help="new tokens per prompt")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    try:
        configs = [parse_config(c) for c in a.configs]
    except ValueError as e:
        p.error(str(e))
    if len(set(a.configs)) != len(a.configs):
        p.error(f"--configs {a.configs}: each configuration at most once")
    if not 1 <= a.prompts <= 40:
        p.error(f"--prompts={a.prompts}: allowed 1..40")
    if a.tokens < 1:
        p.error(f"--tokens={a.tokens}: allowed >= 1")
    if a.temperature < 0:
        p.error(f"--temperature={a.temperature}: allowed >= 0")
    torch.set_num_threads(a.threads)
    model, tok, _ = load_default(method="autoregressive", dtype="bfloat16")
    draft = load_head(SHIPPED_HEAD, model, "auto")
    runs = []
    for text, (D, F, S, B, flat) in zip(a.configs, configs):
        tree = TreeConfig(depth=D, frontier=F, slots=S, budget=B, rheostat=1, verifier="rheo")
        cost = load_cost_model(model, tok, draft, tree, draft_id=f"eagle3:{os.path.abspath(SHIPPED_HEAD)}")
        cost = priced(cost, runs[0][2] if runs else cost, flat)
        runs.append((text, Method(text, tree, cost=True), cost))
    prompts = [encode_prompt(tok, t, chat=True) for _, t in load_prompts(a.prompts)]
    keys = ("steps", "emitted", "predicted", "priced", "nodes", "drafted", "full", "tokens", "seconds")
    tot = {text: dict.fromkeys(keys, 0.0) for text, _, _ in runs}
    for j, ids in enumerate(prompts):
        for text, method, cost in runs:
            n, _, sec, res = decode_prompt(model, tok, draft, method, ids, a.temperature, a.seed * 1000 + j,
                                           a.tokens, cost_model=cost)
            t = tot[text]
            t["tokens"] += n
            t["seconds"] += sec
            for s in res.steps:
                t["steps"] += 1
                t["emitted"] += s.accepted + 1
                t["nodes"] += s.tree_size
                if s.predicted_tokens is not None:  # as DecodeResult.predicted_tokens_per_step
                    t["predicted"] += s.predicted_tokens
                    t["priced"] += 1
                if s.drafted and s.tree_size:
                    t["drafted"] += 1
                    t["full"] += s.tree_size >= method.tree.budget
        print(f"prompt {j + 1}/{len(prompts)} done", flush=True)
    print(f"\n{len(prompts)} held-out prompts x {a.tokens} tokens, T = {a.temperature:g}, seed {a.seed}, "
          f"{torch.get_num_threads()} threads; verify ms at 1 token {runs[0][2].timings.verify_lo[0]:.1f}\n")
    print("| depth/frontier/slots/budget/flat | mean accepted length | predicted | kept nodes a step | "
          "drafted steps at the whole budget | tok/s here |")
    print("|---|---|---|---|---|---|")
    for text, _, _ in runs:
        t = tot[text]
        print(f"| {text} | {t['emitted'] / t['steps']:.2f} | {t['predicted'] / max(t['priced'], 1):.2f} | "
              f"{t['nodes'] / t['steps']:.1f} | {t['full'] / max(t['drafted'], 1):.0%} | "
              f"{t['tokens'] / t['seconds']:.1f} |")


if __name__ == "__main__":
    main()
