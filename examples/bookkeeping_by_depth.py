"""How a tree step's bookkeeping grows with the tree's depth, and what pricing it pays.

Two measurements on the embedded SmolLM2 and the shipped head (bfloat16, held-out prompts,
64 new tokens each), which docs/results.md ("Lean steps, twelfth round") quotes:

* ``--depths 1 3 6 --batch 1 4``: decodes with fixed trees (frontier 3, slots 3; budget 3
  at depth 1, else 3 per depth, capped at 18) at each batch size and prints the median
  per-step draft, plan, verify forward, walk and commit times and the bookkeeping (the
  step less its draft calls and forward: what the cost model calls ``c_o``);
* ``--ab``: the cost model as the loader measures it (bookkeeping at one depth plus a
  cost per further depth, ``Timings.tree_overhead``) against the same latencies with one
  bookkeeping price for every tree (the fixed depth-6 tree's, what the cost model used
  before), interleaved prompt by prompt in one process; prints tokens/s, the mean
  accepted length and the mean kept tree.

Usage:
    python examples/bookkeeping_by_depth.py [--depths 1 3 6] [--batch 1 4] [--prompts 8]
    python examples/bookkeeping_by_depth.py --ab [--prompts 24] [--temperatures 1 0]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch


def fixed_tree(depth: int):
    from rheoplan.config import TreeConfig

    return TreeConfig(depth=depth, frontier=3, slots=3, budget=3 if depth == 1 else min(18, 3 * depth),
                      rheostat=1, support=128)


def by_depth(model, draft, prompts, depths, batches, temperature) -> None:
    from rheoplan.config import SamplingConfig
    from rheoplan.decode import plan_and_decode

    s = SamplingConfig(temperature=temperature)
    fields = ("t_draft", "t_plan", "t_verify_forward", "t_walk", "t_commit", "t_step")
    print("rows depth | ms per step: draft / plan / forward / walk / commit / step | bookkeeping | kept nodes")
    for B in batches:
        for D in depths:
            tree = fixed_tree(D)
            steps = []
            for k in range(0, len(prompts) - B + 1, B):
                res = plan_and_decode(model, draft, prompts[k:k + B] if B > 1 else prompts[k], max_new_tokens=64,
                                      sampling=s, tree=tree, seed=k)
                res = res if isinstance(res, list) else [res]
                live = min(len(r.steps) for r in res)  # the steps while every row was live
                steps += res[0].steps[1:live]  # the first step runs the prompt through the head
            med = [1e3 * statistics.median(getattr(q, f) for q in steps) for f in fields]
            oh = 1e3 * statistics.median(q.t_step - q.t_draft - q.t_verify_forward for q in steps)
            kept = statistics.mean(q.tree_size for q in steps)
            print(f"{B:4d} {D:5d} | " + " / ".join(f"{x:.1f}" for x in med) + f" | {oh:.1f} | {kept:.1f}")


def flat_price(cost, depth: int):
    """``cost`` with one bookkeeping price for every tree: its tree at ``depth``."""
    tm = cost.timings
    return dataclasses.replace(cost, timings=dataclasses.replace(
        tm, overhead_ms=tm.tree_overhead(1, depth), overhead_depth_ms=0.0))


def ab(model, tok, draft, prompts, temperatures) -> None:
    from rheoplan.bench.batch import DEFAULT_TREE
    from rheoplan.config import SamplingConfig
    from rheoplan.decode import plan_and_decode
    from rheoplan.loading import load_cost_model

    new = load_cost_model(model, tok, draft, DEFAULT_TREE, draft_id="auto")
    old = flat_price(new, DEFAULT_TREE.depth)
    tm = new.timings
    print(f"by depth: c_o(D) = {tm.overhead_ms:.2f} + {tm.overhead_depth_ms:.2f} (D - 1) ms; "
          f"flat: {old.timings.overhead_ms:.2f} ms")
    for T in temperatures:
        s = SamplingConfig(temperature=T)
        plan_and_decode(model, draft, prompts[0], max_new_tokens=8, sampling=s, tree=DEFAULT_TREE, cost_model=new,
                        seed=99)  # warm-up
        acc = {k: [0.0, 0, 0, 0] for k in ("flat", "by depth")}
        for i, p in enumerate(prompts):
            for k in (["flat", "by depth"] if i % 2 == 0 else ["by depth", "flat"]):
                t0 = time.perf_counter()
                r = plan_and_decode(model, draft, p, max_new_tokens=64, sampling=s, tree=DEFAULT_TREE,
                                    cost_model=new if k == "by depth" else old, seed=i)
                a = acc[k]
                a[0] += time.perf_counter() - t0
                a[1] += len(r.tokens)
                a[2] += len(r.steps)
                a[3] += sum(st.tree_size for st in r.steps)
        f, d = acc["flat"], acc["by depth"]
        print(f"T={T}: flat {f[1] / f[0]:.2f} tok/s (accepted length {f[1] / f[2]:.2f}, kept {f[3] / f[2]:.1f}); "
              f"by depth {d[1] / d[0]:.2f} tok/s ({d[1] / d[2]:.2f}, kept {d[3] / d[2]:.1f}): {f[0] / d[0]:.3f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depths", type=int, nargs="+", default=[1, 3, 6])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--temperature", type=float, default=1.0, help="for the fixed trees")
    ap.add_argument("--ab", action="store_true", help="compare the cost model with and without bookkeeping by depth")
    ap.add_argument("--temperatures", type=float, nargs="+", default=[1.0, 0.0], help="for --ab")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    from rheoplan.bench.decode import load_prompts
    from rheoplan.loading import encode_prompt, load_default

    torch.set_num_threads(args.threads)
    model, tok, draft = load_default(method="rheo", draft="auto", dtype="bfloat16")
    prompts = [encode_prompt(tok, p, chat=True) for _, p in load_prompts(args.prompts)]
    if args.ab:
        ab(model, tok, draft, prompts, args.temperatures)
    else:
        by_depth(model, draft, prompts, args.depths, args.batch, args.temperature)


if __name__ == "__main__":
    main()
