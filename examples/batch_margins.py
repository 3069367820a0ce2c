"""The static batch's tail rule side by side: ``generate`` against rheoplan's batched loop
planning for the slowest row at several ``ROW_SPREAD`` values (and a fixed tree), on the
same batches, interleaved batch by batch.

Splits the first ``--rows x --batches`` held-out prompts into batches of ``--rows``; each
batch runs every method in turn (the order rotating from batch to batch): transformers
``generate`` on the left-padded batch, rheoplan's batched loop with the defaults of
``rheoplan generate`` (the shipped head in bfloat16, the cost model) at each spread of
``--spreads`` (``rheoplan.costmodel.ROW_SPREAD``: how much the rows differ in drafted
tokens per step, from which ``slowest_row_tokens`` plans a static batch for its slowest
row; 0 plans for the average row), and a fixed ``--tree DEPTH/BUDGET`` without the cost
model. Prints tokens/s, the speed-up against ``generate`` and the mean accepted length per
row. docs/results.md ("Twenty-seventh round") took its table from it; the "Twenty-fifth
round" compared the fixed margins of the rule before it.

``--queue Q`` makes each unit a queue of ``Q`` prompts instead of one batch: rheoplan's
loop over all ``Q`` at once with at most ``--rows`` live (``max_batch_size``: a finished
row's place is taken by the next prompt), against ``generate`` on the same prompts in
batches of ``--rows``; while prompts wait, no row waits for the slowest, so the spread
matters only in the queue's last steps.

``--tail`` runs only rheoplan at each spread and prints, instead, per batch the wall time,
the sum of the steps' times and how many steps each row took to its tokens (rows that
accept more finish first, and the batch's last steps carry fewer rows at nearly the price
of all of them), and per spread the steps grouped by the widest row's kept drafted nodes
(0: plain), the cost model's predicted step time and emitted tokens against what the steps
took and emitted, over the steps while every row was live. The twenty-sixth round quotes
it: at 4 rows and T = 0 the tree steps ran as predicted, and the rows' uneven finish ate
most of their gain.

Usage:
    python examples/batch_margins.py [--rows 4] [--temperature 0] [--batches 10] [--spreads 0.2,0] [--tree 1/2]
    python examples/batch_margins.py --queue 20 [--rows 4] [--temperature 0] [--batches 2] [--spreads 0.2,0]
    python examples/batch_margins.py --tail [--rows 4] [--temperature 0] [--batches 4] [--spreads 0.2,0]
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--batches", type=int, default=10)
    ap.add_argument("--spreads", default="0.2,0",
                    help="comma-separated ROW_SPREAD values in [0, 1) (0: plan for the average row)")
    ap.add_argument("--tree", default="1/2", metavar="DEPTH/BUDGET", help="a fixed tree to set beside them")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tail", action="store_true", help="rows' steps and per-step predictions instead")
    ap.add_argument("--queue", type=int, default=None, metavar="Q",
                    help="each unit a queue of Q prompts with --rows live (continuous batching)")
    args = ap.parse_args()
    if min(args.rows, args.batches, args.tokens, args.threads) < 1:
        raise SystemExit("--rows, --batches, --tokens and --threads must be >= 1")
    if args.queue is not None and (args.queue <= args.rows or args.tail):
        raise SystemExit(f"--queue={args.queue}: allowed more prompts than --rows={args.rows}, without --tail")
    try:
        spreads = [float(m) for m in args.spreads.split(",")]
        depth, budget = (int(x) for x in args.tree.split("/"))
    except ValueError:
        raise SystemExit(f"--spreads={args.spreads!r} / --tree={args.tree!r}: allowed numbers in [0, 1), "
                         "DEPTH/BUDGET") from None
    if not spreads or any(not 0 <= m < 1 for m in spreads) or min(depth, budget) < 1:
        raise SystemExit("--spreads must be numbers in [0, 1) and --tree two ints >= 1")

    import torch

    import rheoplan.costmodel as costmodel
    from rheoplan import TreeConfig
    from rheoplan.bench.batch import DEFAULT_TREE, run_batched, run_generate
    from rheoplan.bench.decode import load_prompts
    from rheoplan.loading import encode_prompt, load_cost_model, load_default

    torch.set_num_threads(args.threads)
    model, tok, draft = load_default(dtype="bfloat16", draft_dtype="bfloat16")
    cost = load_cost_model(model, tok, draft, DEFAULT_TREE, draft_id="auto")
    unit = args.queue or args.rows  # prompts per unit: one batch, or one queue
    prompts = [encode_prompt(tok, p, True) for _, p in load_prompts(unit * args.batches)]
    T, n = args.temperature, args.tokens
    if args.tail:
        _tail(model, draft, cost, prompts, args.rows, args.batches, spreads, T, n)
        return

    def rheoplan_run(rows, seed, cost_model, tree):
        live = args.rows if args.queue else None  # a queue: at most --rows live
        return run_batched(model, draft, rows, T, seed, n, cost_model, tree, max_batch_size=live)

    def generate_run(rows, seed):  # batches of --rows (one batch without --queue)
        out = {"tokens": 0, "seconds": 0.0, "row_tau": []}
        for j in range(0, len(rows), args.rows):
            r = run_generate(model, tok.eos_token_id, rows[j:j + args.rows], T, seed + j, n)
            for key in out:
                out[key] += r[key]
        return out

    def at_spread(m):
        def run(rows, seed):
            before = costmodel.ROW_SPREAD
            costmodel.ROW_SPREAD = m
            try:
                return rheoplan_run(rows, seed, cost, DEFAULT_TREE)
            finally:
                costmodel.ROW_SPREAD = before
        return run

    fixed = TreeConfig(depth=depth, budget=budget, frontier=min(3, budget), slots=3, rheostat=1, verifier="rheo")
    methods = {"generate": generate_run}
    methods.update({f"spread {m}": at_spread(m) for m in spreads})
    methods[f"fixed {depth}/{budget}"] = lambda rows, seed: rheoplan_run(rows, seed, None, fixed)
    run_generate(model, tok.eos_token_id, prompts[:args.rows], T, 0, 4)  # warm-up
    acc = {m: [0, 0.0, []] for m in methods}
    names = list(methods)
    for k in range(args.batches):
        rows = prompts[k * unit:(k + 1) * unit]
        for m in names[k % len(names):] + names[:k % len(names)]:
            r = methods[m](rows, 1000 + k)
            acc[m][0] += r["tokens"]
            acc[m][1] += r["seconds"]
            acc[m][2] += r["row_tau"]
    base = acc["generate"][0] / acc["generate"][1]
    print(f"{args.rows} rows, T = {T}, {args.batches} " + (f"queues of {args.queue} prompts" if args.queue else "batches"))
    for m, (tokens, seconds, taus) in acc.items():
        print(f"{m:14s} {tokens / seconds:7.1f} tok/s  {tokens / seconds / base:5.2f}x  "
              f"mean accepted length per row {statistics.mean(taus):.2f}")



def _tail(model, draft, cost, prompts, rows_per_batch, batches, spreads, T, n) -> None:
    """``--tail``: per batch and spread the wall time and the rows' step counts; per spread
    the live steps' predicted against taken time and tokens, by the widest row's tree."""
    import rheoplan.costmodel as costmodel
    from rheoplan import SamplingConfig, plan_and_decode
    from rheoplan.bench.batch import DEFAULT_TREE

    sampling = SamplingConfig(temperature=T)
    by_size = {m: collections.defaultdict(list) for m in spreads}
    before = costmodel.ROW_SPREAD
    try:
        for k in range(batches):
            rows = prompts[k * rows_per_batch:(k + 1) * rows_per_batch]
            for m in spreads if k % 2 == 0 else spreads[::-1]:
                costmodel.ROW_SPREAD = m
                t0 = time.perf_counter()
                res = plan_and_decode(model, draft, rows, max_new_tokens=n, sampling=sampling, tree=DEFAULT_TREE,
                                      seed=k, cost_model=cost)
                wall = time.perf_counter() - t0
                longest = max(res, key=lambda r: len(r.steps)).steps  # every live row shares a step's time
                print(f"batch {k} spread {m}: wall {wall * 1e3:.0f} ms, steps {1e3 * sum(s.t_step for s in longest):.0f} ms, "
                      f"steps per row {[len(r.steps) for r in res]}")
                live = min(len(r.steps) for r in res)
                for i in range(1, live):  # while every row was live; step 0 ran the prompts
                    st = [r.steps[i] for r in res]
                    if st[0].predicted_ms:
                        size = max(s.tree_size for s in st) if any(s.drafted for s in st) else 0
                        by_size[m][size].append((st[0].predicted_ms, 1e3 * st[0].t_step, st[0].predicted_tokens,
                                                 sum(s.emitted for s in st)))
    finally:
        costmodel.ROW_SPREAD = before
    for m in spreads:
        print(f"spread {m}: steps by the widest row's kept drafted nodes (0: plain), while every row was live")
        for size in sorted(by_size[m]):
            xs = by_size[m][size]
            mean = [statistics.mean(x[j] for x in xs) for j in range(4)]
            print(f"  {size:3d}: {len(xs):4d} steps, predicted {mean[0]:.1f} ms / {mean[2]:.2f} tokens, "
                  f"took {mean[1]:.1f} ms / {mean[3]:.2f} tokens")


if __name__ == "__main__":
    main()
