"""Tokens and per-phase ms per step of a few SmolLM2 decodes, and a check that a change to
the loop's bookkeeping kept every token.

Decodes held-out prompts with rheoplan's autoregressive loop, the cost model's default
trees and the fixed depth-4 trees (``rheo-m1-ot``, ``eagle``) at each temperature, seed =
the prompt's index, and prints the StepStats phases in ms per step (``loop_other`` is
the step's wall time outside the phases; ``bookkeeping`` = plan + walk + commit +
loop_other, the lean-step goal's sum); ``--generate`` also times transformers ``generate``
on the same prompts (ms per token, for the autoregressive loop's ratio). ``--out`` writes the tokens and phases as JSON;
``--compare OLD.json`` then says whether every decode gave the same tokens as the run
that wrote OLD.json (same settings and cached cost-model latencies: run it before and
after a change that must not change the output).

Usage:
    python examples/step_phases.py --out before.json          # on the old code
    python examples/step_phases.py --out after.json --compare before.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from rheoplan.bench.decode import load_prompts, methods_for
from rheoplan.config import SamplingConfig
from rheoplan.decode import plan_and_decode
from rheoplan.loading import FIXED_TREE, encode_prompt, load_cost_model, load_default

PHASES = ("t_draft", "t_plan", "t_verify_forward", "t_walk", "t_commit")


def phases(steps, tokens: int, seconds: float) -> dict:
    n = len(steps)
    out = {k[2:]: 1e3 * sum(getattr(s, k) for s in steps) / n for k in PHASES}
    out["loop_other"] = 1e3 * sum(s.t_step for s in steps) / n - sum(out.values())
    out["bookkeeping"] = out["plan"] + out["walk"] + out["commit"] + out["loop_other"]
    out["tau"] = tokens / n
    out["ms_per_token"] = 1e3 * seconds / tokens
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--temperatures", type=float, nargs="+", default=[1.0, 0.0])
    ap.add_argument("--methods", nargs="+", default=["autoregressive", "default", "rheo-m1-ot", "eagle"])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--generate", action="store_true", help="also time transformers generate")
    ap.add_argument("--out", default=None)
    ap.add_argument("--compare", default=None, help="a JSON written by --out: are the tokens the same?")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    model, tok, draft = load_default(method="rheo", draft="auto", dtype=a.dtype)
    methods = methods_for(**FIXED_TREE)
    cost = load_cost_model(model, tok, draft, methods["default"].tree, draft_id="auto")
    prompts = [encode_prompt(tok, p, chat=True) for _, p in load_prompts(a.prompts)]
    plan_and_decode(model, draft, prompts[0], max_new_tokens=4, tree=methods["eagle"].tree, seed=1)  # warm-up
    record = {"args": vars(a), "tokens": {}, "phases": {}}
    for T in a.temperatures:
        if a.generate:
            seconds = 0.0
            for j, ids in enumerate(prompts):
                torch.manual_seed(j)
                kw = dict(do_sample=True, temperature=T) if T > 0 else dict(do_sample=False)
                t0 = time.perf_counter()
                with torch.no_grad():
                    model.generate(torch.tensor([ids]), max_new_tokens=a.tokens, min_new_tokens=a.tokens, top_k=0,
                                   top_p=1.0, pad_token_id=tok.eos_token_id, **kw)
                seconds += time.perf_counter() - t0
            ms = 1e3 * seconds / (a.tokens * len(prompts))
            record["phases"][f"generate T={T}"] = {"ms_per_token": ms}
            print(f"{'generate T=' + str(T):24s} ms_per_token {ms:.2f}", flush=True)
        for name in a.methods:
            m = methods["eagle" if name == "autoregressive" else name]
            toks, steps, seconds = [], [], 0.0
            for j, ids in enumerate(prompts):
                t0 = time.perf_counter()
                r = plan_and_decode(model, None if name == "autoregressive" else draft, ids,
                                    max_new_tokens=a.tokens, sampling=SamplingConfig(temperature=T),
                                    tree=m.tree, seed=j, cost_model=cost if m.cost else None)
                seconds += time.perf_counter() - t0
                toks.append(r.tokens)
                steps += r.steps
            key = f"{name} T={T}"
            record["tokens"][key] = toks
            record["phases"][key] = ph = phases(steps, sum(len(t) for t in toks), seconds)
            print(f"{key:24s} " + " ".join(f"{k} {v:.2f}" for k, v in ph.items()), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(record, f)
    if a.compare:
        with open(a.compare) as f:
            old = json.load(f)["tokens"]
        diff = [k for k in record["tokens"] if k in old and old[k] != record["tokens"][k]]
        same = [k for k in record["tokens"] if k in old and old[k] == record["tokens"][k]]
        print(f"same tokens as {a.compare}: {len(same)} of {len(same) + len(diff)} decodes"
              + (f"; DIFFERENT: {diff}" if diff else ""))
        return 1 if diff else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
