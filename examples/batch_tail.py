"""A batch's tree steps against its finish: per-step predictions, then the rows' step counts.

Decodes held-out prompts in batches of ``--rows`` with the defaults of ``rheoplan
generate`` (the shipped head in bfloat16, the cost model) at each batch margin of
``--margins`` (``rheoplan.costmodel.BATCH_MARGIN``, alternating batch by batch), and prints

* per margin, the steps grouped by the widest row's kept drafted nodes: the cost model's
  predicted step time and emitted tokens against what the steps took and emitted;
* per batch and margin, the wall time, the sum of the steps' times and how many steps each
  row took to its tokens: rows that accept more finish first, and the batch's last steps
  carry fewer rows at nearly the price of all of them.

docs/results.md ("Twenty-fifth round") quotes it: at 4 rows and T = 0 the 4-row tree steps
ran as predicted, and the rows' uneven finish ate most of their gain.

Usage:
    python examples/batch_tail.py [--rows 4] [--batches 4] [--temperature 0] [--margins 1.4,1.0] [--tokens 64]
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--batches", type=int, default=4)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--margins", default="1.4,1.0", help="comma-separated BATCH_MARGIN values, each >= 1")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    if min(args.rows, args.batches, args.tokens, args.threads) < 1:
        raise SystemExit("--rows, --batches, --tokens and --threads must be >= 1")
    try:
        margins = [float(m) for m in args.margins.split(",")]
    except ValueError:
        raise SystemExit(f"--margins={args.margins!r}: allowed comma-separated numbers >= 1") from None
    if not margins or min(margins) < 1:
        raise SystemExit(f"--margins={args.margins!r}: allowed comma-separated numbers >= 1")

    import torch

    import rheoplan.costmodel as costmodel
    from rheoplan import SamplingConfig, plan_and_decode
    from rheoplan.bench.batch import DEFAULT_TREE
    from rheoplan.bench.decode import load_prompts
    from rheoplan.loading import encode_prompt, load_cost_model, load_default

    torch.set_num_threads(args.threads)
    model, tok, draft = load_default(dtype="bfloat16", draft_dtype="bfloat16")
    cost = load_cost_model(model, tok, draft, DEFAULT_TREE, draft_id="auto")
    prompts = [encode_prompt(tok, p, True) for _, p in load_prompts(args.rows * args.batches)]
    sampling = SamplingConfig(temperature=args.temperature)
    by_size = {m: collections.defaultdict(list) for m in margins}
    before = costmodel.BATCH_MARGIN
    try:
        for k in range(args.batches):
            rows = prompts[k * args.rows:(k + 1) * args.rows]
            for m in margins if k % 2 == 0 else margins[::-1]:
                costmodel.BATCH_MARGIN = m
                t0 = time.perf_counter()
                res = plan_and_decode(model, draft, rows, max_new_tokens=args.tokens, sampling=sampling,
                                      tree=DEFAULT_TREE, seed=k, cost_model=cost)
                wall = time.perf_counter() - t0
                longest = max(res, key=lambda r: len(r.steps)).steps  # every live row shares a step's time
                print(f"batch {k} margin {m}: wall {wall * 1e3:.0f} ms, steps {1e3 * sum(s.t_step for s in longest):.0f} ms, "
                      f"steps per row {[len(r.steps) for r in res]}")
                live = min(len(r.steps) for r in res)
                for i in range(1, live):  # while every row was live; step 0 ran the prompts
                    st = [r.steps[i] for r in res]
                    if st[0].predicted_ms:
                        size = max(s.tree_size for s in st) if any(s.drafted for s in st) else 0
                        by_size[m][size].append((st[0].predicted_ms, 1e3 * st[0].t_step, st[0].predicted_tokens,
                                                 sum(s.emitted for s in st)))
    finally:
        costmodel.BATCH_MARGIN = before
    for m in margins:
        print(f"margin {m}: steps by the widest row's kept drafted nodes (0: plain), while every row was live")
        for size in sorted(by_size[m]):
            xs = by_size[m][size]
            mean = [statistics.mean(x[j] for x in xs) for j in range(4)]
            print(f"  {size:3d}: {len(xs):4d} steps, predicted {mean[0]:.1f} ms / {mean[2]:.2f} tokens, "
                  f"took {mean[1]:.1f} ms / {mean[3]:.2f} tokens")


if __name__ == "__main__":
    main()
