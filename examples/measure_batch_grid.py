"""The batched verify grid against the forwards a batched decode really runs, on this machine.

The cost model prices a batch's verify forward from a grid of rectangular forwards (rows x
tokens per row, ``rheoplan.probe.measure_batch_verify``). Until the thirty-first round
that grid called the transformers model itself (``model.model(input_ids=...,
attention_mask=...)``), while a batched decode runs ``_hf_common.run_base_rows``: the lean
decoder forward (no per-layer dispatch) with its folded attention. On a 2-core Zen 4 EPYC
the model's own call took 1.08-1.23x the decode's at 4 rows x 2-3 tokens, and the cost
model kept plain 4-row steps that ran 10% slower than one level of two children
(docs/results.md, "Thirty-first round").

For each fixed tree (one level of one and of two children, two levels of two, three
levels of three: 2, 3, 5 and 7 tokens in the widest row), this script decodes
``--rows`` held-out prompts as one static batch and prints the median verify forward
(``StepStats.t_verify_forward``, the steps while every row was live, the first left out)
next to the grid's forward of the same shape timed right after it: through the decode's
call (what ``batch_forwards`` times now) and through the model's own call (what it timed
before), both over ``--ctx`` random cached entries per row and after an output projection,
medians of ``--reps`` round-robin rounds.

docs/results.md, "Thirty-first round", quotes it:

    python examples/measure_batch_grid.py [--rows 4] [--temperature 0] [--ctx 64] [--reps 5]
"""

from __future__ import annotations

import argparse
import statistics

import torch

#: (depth, frontier, slots, budget) of the fixed trees decoded
TREES = ((1, 1, 2, 1), (1, 1, 2, 2), (2, 2, 2, 4), (3, 3, 3, 6))


def model_call(base, cache, tok, pos, allowed) -> None:
    """The grid's forward as it was before the thirty-first round: the same cache, tokens
    and mask (``probe.batch_forwards``), through the transformers model's own forward."""
    from rheoplan.models._hf_common import _cache_kwarg, additive_mask

    B, n, S = allowed.shape  # every row alike: one mask expanded over the rows, as the old grid built it
    mask = additive_mask(allowed[0], next(base.parameters()).dtype).expand(B, 1, n, S)
    base(input_ids=tok, position_ids=pos, attention_mask=mask, use_cache=True, **{_cache_kwarg(base): cache})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=4, help="prompts in the batch (>= 2)")
    ap.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (>= 0)")
    ap.add_argument("--tokens", type=int, default=32, help="new tokens per row (>= 4)")
    ap.add_argument("--ctx", type=int, default=64, help="cached entries per row of the grid's forwards (>= 1)")
    ap.add_argument("--reps", type=int, default=5, help="round-robin rounds per grid shape (>= 1)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (>= 1)")
    args = ap.parse_args(argv)
    for name, low in (("rows", 2), ("tokens", 4), ("ctx", 1), ("reps", 1), ("threads", 1)):
        if getattr(args, name) < low:
            ap.error(f"--{name}={getattr(args, name)}: allowed >= {low}")
    if args.temperature < 0:
        ap.error(f"--temperature={args.temperature}: allowed >= 0")
    torch.set_num_threads(args.threads)

    from rheoplan import SamplingConfig, TreeConfig, plan_and_decode
    from rheoplan.bench.batch import encode_prompt, load_prompts
    from rheoplan.loading import load_default
    from rheoplan.probe import batch_forwards, batch_verify_ms, output_projection_gap, round_robin_ms

    model, tok, draft = load_default(dtype="bfloat16", draft_dtype="bfloat16")
    prompts = [encode_prompt(tok, p, chat=True) for _, p in load_prompts(args.rows)]
    sampling = SamplingConfig(temperature=args.temperature)
    print(f"{args.rows} rows, T = {args.temperature}, bfloat16, {args.threads} threads; ms per verify forward")
    print("| tree (depth x frontier x slots, budget) | widest row | decode's forward | grid, decode's call "
          "| grid, model's own call | decode / decode's call | decode / model's call |")
    print("|---|---|---|---|---|---|---|")
    for depth, frontier, slots, budget in TREES:
        tree = TreeConfig(depth=depth, frontier=frontier, slots=slots, budget=budget, rheostat=1)
        res = plan_and_decode(model, draft, prompts, max_new_tokens=args.tokens, sampling=sampling, tree=tree, seed=0)
        live = range(1, min(len(r.steps) for r in res))
        real = statistics.median(1e3 * res[0].steps[i].t_verify_forward for i in live)
        n = int(round(statistics.median(1 + max(r.steps[i].tree_size for r in res) for i in live)))
        ours = batch_verify_ms(model, args.rows, (n,), args.ctx, reps=args.reps)[0]
        theirs = round_robin_ms(batch_forwards(model, args.rows, (n,), args.ctx, run=model_call), reps=args.reps,
                                before=output_projection_gap(model))[0]
        print(f"| {depth} x {frontier} x {slots}, {budget} | {n} | {real:.2f} | {ours:.2f} | {theirs:.2f} "
              f"| {real / ours:.2f} | {real / theirs:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
