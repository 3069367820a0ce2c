"""Where a batched decode's time goes, against transformers ``generate`` on the same rows.

Decodes the first ``--rows`` held-out prompts as one batch, alternately with ``generate``
(the left-padded batch, as ``rheoplan bench batch`` runs it) and with rheoplan's batched
loop (the defaults of ``rheoplan generate``: the shipped head, the cost model), and times
every forward of the decoder stack with hooks. Each run is split into the prefill (the
forwards before the first one-token forward), the step forwards, and the time outside the
forwards per step (the output projection, the sampling or greedy pick, rheoplan's plan,
walk and commit, ``generate``'s own loop). docs/results.md ("Sixteenth measurement")
quotes it: at 4 rows and T = 0 the two loops' steps were level.

Usage:
    python examples/batch_phases.py [--rows 4] [--temperature 0] [--rounds 3] [--tokens 64] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time


def split_forwards(spans: list[tuple[float, float, int]], wall: float) -> dict:
    """``spans``: ``(start, end, new tokens per row)`` of each decoder-stack forward of one
    decode, in order; ``wall``: the decode's wall seconds. Returns the prefill (every
    forward before the first one-token forward: ``prefill_s``, ``prefill_forwards``), the
    later forwards (``step_s``, ``steps``) and the rest per step (``outside_ms``).

    Example: two prefill forwards of 0.2 s, then two steps of 0.03 s, in 0.5 s:
        >>> r = split_forwards([(0, .1, 40), (.1, .2, 9), (.2, .23, 1), (.25, .28, 1)], 0.5)
        >>> r["prefill_forwards"], r["steps"], round(r["outside_ms"], 1)
        (2, 2, 120.0)
    """
    first = next((i for i, (_, _, n) in enumerate(spans) if n == 1), len(spans))
    prefill = sum(b - a for a, b, _ in spans[:first])
    steps = sum(b - a for a, b, _ in spans[first:])
    n = len(spans) - first
    return {"prefill_s": prefill, "prefill_forwards": first, "step_s": steps, "steps": n,
            "outside_ms": 1e3 * (wall - prefill - steps) / max(n, 1)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    if args.rows < 1 or args.rounds < 1 or args.tokens < 1:
        raise SystemExit(f"--rows={args.rows}, --rounds={args.rounds}, --tokens={args.tokens}: allowed >= 1 each")

    import torch

    from rheoplan.bench.batch import DEFAULT_TREE, run_batched, run_generate
    from rheoplan.bench.decode import load_prompts
    from rheoplan.loading import encode_prompt, load_cost_model, load_default
    from rheoplan.models._hf_common import base_model

    torch.set_num_threads(args.threads)
    model, tok, draft = load_default(method="rheo", draft="auto", dtype="auto")
    cost = load_cost_model(model, tok, draft, DEFAULT_TREE, draft_id="auto")
    rows = [encode_prompt(tok, p, chat=True) for _, p in load_prompts(args.rows)]
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    spans: list[list] = []
    base = base_model(model)

    def before(module, a, kw):
        ids = kw.get("input_ids") if kw.get("input_ids") is not None else a[0]
        spans.append([time.perf_counter(), None, int(ids.shape[-1])])

    def after(module, a, kw, out):
        spans[-1][1] = time.perf_counter()

    hooks = [base.register_forward_pre_hook(before, with_kwargs=True),
             base.register_forward_hook(after, with_kwargs=True)]
    runs: dict[str, list[dict]] = {"generate": [], "batched": []}
    print(f"{args.rows} rows x {args.tokens} tokens, T = {args.temperature}")
    print("| run | method | tok/s | prefill s (forwards) | step forward ms | outside the forwards ms/step |")
    print("|---|---|---|---|---|---|")
    try:
        for r in range(args.rounds):
            for name in ("generate", "batched") if r % 2 == 0 else ("batched", "generate"):
                spans.clear()
                t0 = time.perf_counter()
                if name == "generate":
                    res = run_generate(model, pad, rows, args.temperature, r, args.tokens)
                else:
                    res = run_batched(model, draft, rows, args.temperature, r, args.tokens, cost, DEFAULT_TREE)
                wall = time.perf_counter() - t0
                s = split_forwards([tuple(x) for x in spans], wall)
                s["tok_s"] = res["tokens"] / wall
                runs[name].append(s)
                print(f"| {r} | {name} | {s['tok_s']:.1f} | {s['prefill_s']:.3f} ({s['prefill_forwards']}) | "
                      f"{1e3 * s['step_s'] / max(s['steps'], 1):.1f} | {s['outside_ms']:.2f} |", flush=True)
    finally:
        for h in hooks:
            h.remove()
    for name, xs in runs.items():
        print(f"{name}: mean {statistics.mean(x['tok_s'] for x in xs):.1f} tok/s; outside the forwards "
              f"{min(x['outside_ms'] for x in xs):.2f}-{max(x['outside_ms'] for x in xs):.2f} ms/step; prefill "
              f"{min(x['prefill_s'] for x in xs):.3f}-{max(x['prefill_s'] for x in xs):.3f} s")


if __name__ == "__main__":
    main()
