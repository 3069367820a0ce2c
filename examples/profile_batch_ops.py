"""The operators of a batched decode, from torch.profiler: which ops a step spends on.

Decodes the first ``--rows`` held-out prompts as one batch once to warm up, then once under
``torch.profiler`` (the shipped head in bfloat16; the cost model's trees by default, or a
fixed ``--tree DEPTH/BUDGET``), and prints the operators by self time and, with their
input shapes, the attention calls (``scaled_dot_product_attention``'s kernels) and the
largest products. docs/results.md ("Twenty-fifth round") used it to find the masked
attention of a 4-row tree verify forward at 110-118 us a layer.

Usage:
    python examples/profile_batch_ops.py [--rows 4] [--temperature 1] [--tree 2/2] [--tokens 64] [--threads 2]
"""

from __future__ import annotations

import argparse
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--tree", default=None, metavar="DEPTH/BUDGET",
                    help="a fixed tree (frontier min(3, budget), 3 slots) instead of the cost model's")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--top", type=int, default=15, help="rows of each table")
    args = ap.parse_args()
    if args.rows < 1 or args.tokens < 1 or args.threads < 1 or args.top < 1:
        raise SystemExit("--rows, --tokens, --threads and --top must be >= 1")
    tree_arg = None
    if args.tree is not None:
        try:
            tree_arg = tuple(int(x) for x in args.tree.split("/"))
            assert len(tree_arg) == 2 and min(tree_arg) >= 1
        except (ValueError, AssertionError):
            raise SystemExit(f"--tree={args.tree!r}: allowed DEPTH/BUDGET, two ints >= 1 (e.g. 2/2)") from None

    import torch
    from torch.profiler import ProfilerActivity, profile

    from rheoplan import SamplingConfig, TreeConfig, plan_and_decode
    from rheoplan.bench.batch import DEFAULT_TREE
    from rheoplan.bench.decode import load_prompts
    from rheoplan.loading import encode_prompt, load_cost_model, load_default

    torch.set_num_threads(args.threads)
    model, tok, draft = load_default(dtype="bfloat16", draft_dtype="bfloat16")
    tree, cost = DEFAULT_TREE, None
    if tree_arg is None:
        cost = load_cost_model(model, tok, draft, DEFAULT_TREE, draft_id="auto")
    else:
        d, b = tree_arg
        tree = TreeConfig(depth=d, budget=b, frontier=min(3, b), slots=3, rheostat=1, verifier="rheo")
    rows = [encode_prompt(tok, p, True) for _, p in load_prompts(args.rows)]
    sampling = SamplingConfig(temperature=args.temperature)
    run = lambda n: plan_and_decode(model, draft, rows, max_new_tokens=n, sampling=sampling, tree=tree,  # noqa: E731
                                    seed=0, cost_model=cost)
    run(8)
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        res = run(args.tokens)
    wall = time.perf_counter() - t0
    steps = max(len(r.steps) for r in res)
    total = sum(e.self_cpu_time_total for e in prof.key_averages()) / 1e3
    print(f"{args.rows} rows, {steps} steps, {sum(len(r.tokens) for r in res)} tokens; "
          f"{total / steps:.1f} ms of operators per step ({wall / steps * 1e3:.1f} ms a step under the profiler)")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))
    shaped = sorted(prof.key_averages(group_by_input_shape=True), key=lambda e: -e.self_cpu_time_total)
    for title, keep in (("attention calls", lambda k: "scaled_dot_product" in k and "flash" in k),
                        ("products", lambda k: "linear" in k or "addmm" in k or k == "aten::mm")):
        print(f"{title} by input shape: ms per step, calls per step, us per call, shapes")
        for e in [e for e in shaped if keep(e.key)][:args.top]:
            print(f"  {e.self_cpu_time_total / 1e3 / steps:7.3f} {e.count / steps:6.1f} "
                  f"{e.self_cpu_time_total / e.count:8.1f}  {str(e.input_shapes)[:110]}")


if __name__ == "__main__":
    main()
