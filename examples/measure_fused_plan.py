"""A decode's plan fused against its pass list, in one process (docs/results.md, "Thirty-fourth round").

One-row decodes of held-out prompts as ``rheoplan generate`` runs them (bfloat16, the
shipped head, the cost model), each prompt twice, alternating which goes first:

* ``fused``: the default, the cost pipeline as one function
  (``rheoplan.kernels.plan.cpu_pipeline.plan_cost_tree``: the passes writing the tree they
  are given, without the pass objects and hooks);
* ``passes``: ``passes=DEFAULT_PIPELINE``, which a decode never fuses: the same passes
  through ``plan_tree`` and ``run_pipeline``, each copying what it writes.

Prints per variant the plan's and the draft calls' ms per step, a drafted depth against
its draft call (``(draft + plan) / draft``, as ``rheoplan bench decode`` reports it),
tokens/s, and whether every prompt got the same tokens both ways (it must: the same
trees).

    python examples/measure_fused_plan.py [--prompts 12] [--tokens 64] [--temperature 1.0] [--threads 2] [--reps 1]
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=1, help="passes over the prompts (default 1)")
    args = ap.parse_args()
    for name in ("prompts", "tokens", "threads", "reps"):
        if getattr(args, name) < 1:
            ap.error(f"--{name}={getattr(args, name)}: allowed >= 1")
    if args.temperature < 0:
        ap.error(f"--temperature={args.temperature}: allowed >= 0")
    from rheoplan.bench.batch import DEFAULT_TREE
    from rheoplan.bench.decode import load_prompts
    from rheoplan.config import SamplingConfig
    from rheoplan.decode import plan_and_decode
    from rheoplan.loading import encode_prompt, load_cost_model, load_default
    from rheoplan.planner.default import DEFAULT_PIPELINE

    torch.set_num_threads(args.threads)
    model, tok, draft = load_default(method="rheo", draft="auto", dtype="bfloat16")
    cost = load_cost_model(model, tok, draft, DEFAULT_TREE, draft_id="auto")
    prompts = [encode_prompt(tok, p, chat=True) for _, p in load_prompts(args.prompts)]
    sampling = SamplingConfig(temperature=args.temperature)
    variants = {"fused": None, "passes": DEFAULT_PIPELINE}

    def decode(i, passes):
        return plan_and_decode(model, draft, prompts[i], max_new_tokens=args.tokens, sampling=sampling,
                               tree=DEFAULT_TREE, cost_model=cost, seed=i, passes=passes)

    for passes in variants.values():  # warm-up, not counted
        decode(0, passes)
    stats = {name: {"steps": 0, "plan": 0.0, "draft": 0.0, "seconds": 0.0, "tokens": 0, "out": []}
             for name in variants}
    for rep in range(args.reps):
        for i in range(len(prompts)):
            order = list(variants) if (i + rep) % 2 == 0 else list(variants)[::-1]
            for name in order:
                t0 = time.perf_counter()
                r = decode(i, variants[name])
                s = stats[name]
                s["seconds"] += time.perf_counter() - t0
                s["steps"] += len(r.steps)
                s["plan"] += sum(st.t_plan for st in r.steps)
                s["draft"] += sum(st.t_draft for st in r.steps)
                s["tokens"] += len(r.tokens)
                s["out"].append(r.tokens)
    same = sum(a == b for a, b in zip(stats["fused"]["out"], stats["passes"]["out"]))
    print(f"{len(prompts)} prompts x {args.reps}, T = {args.temperature}, {args.tokens} tokens each")
    print("| variant | plan ms/step | draft ms/step | drafted depth / draft call | tok/s |")
    print("|---|---|---|---|---|")
    for name, s in stats.items():
        n = max(s["steps"], 1)
        ratio = (s["plan"] + s["draft"]) / s["draft"] if s["draft"] else float("nan")
        print(f"| {name} | {1e3 * s['plan'] / n:.3f} | {1e3 * s['draft'] / n:.3f} | {ratio:.3f}x | "
              f"{s['tokens'] / s['seconds']:.2f} |")
    print(f"same tokens: {same} of {len(stats['fused']['out'])} decodes")


if __name__ == "__main__":
    main()
