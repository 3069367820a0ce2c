"""Where a decode step's time goes, and the accepted length that would pay for it
(``rheoplan bench cost``).

A speculative step beats autoregressive decoding only when the tokens it emits (the
mean accepted length tau) would have cost more as tau autoregressive steps:

    tau * t_ar  >  t_draft + t_plan + t_verify + t_walk + t_commit + t_other   (per step)

so ``step time / t_ar`` is the *break-even* tau. This benchmark measures every term on
SmolLM2-135M-Instruct with the shipped head, in one process and on the same held-out
prompts: transformers ``generate`` (t_ar), rheoplan's loop without a draft, the one-hot
EAGLE tree and RheoSampling at the same node budget, and ``default`` (the cost model
planning every tree, as ``rheoplan generate`` does). It prints ms per step by phase, the
break-even tau next to the measured one, and the cost of one target forward as a
function of how many new tokens it carries (why a wide tree is not free on a CPU).
A last table checks the lean-step goals: rheoplan's own autoregressive loop against
``generate`` per token, the per-step bookkeeping (plan + walk + commit + the loop, prefill
excluded) and a drafted depth against its draft call alone.
``--out`` receives ``cost.json`` and ``cost.png``.

    rheoplan bench cost --prompts 8 --tokens 24 --temperature 1.0 --threads 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Sequence

import torch

from tqdm.auto import tqdm

from rheoplan.bench.decode import Method, check_run_args, load_prompts, methods_for, run_group, run_one
from rheoplan.bench.phases import PHASES, breakdown
from rheoplan.config import SamplingConfig
from rheoplan.loading import FIXED_TREE, add_dtype, encode_prompt, load_cost_model, load_default, model_dtype
from rheoplan.models._hf_common import (base_model, cache_length, crop_cache, new_cache, output_head,
                                        prefix_and_block_mask, run_base)

#: methods measured: transformers generate, our loop without a draft, then tree methods
TREE_METHODS = ("eagle", "rheo-m1-ot", "rheo-m1-rheo", "default")


def lean_checks(rows: list[dict], ar_ms: float) -> str:
    """The lean-step goals as a table: rheoplan's autoregressive loop against ``generate``
    per token (goal <= 1.03x), plan + walk + commit + loop bookkeeping per step (goal
    <= 4 ms at the default tree; the walk's output projection, model compute, shown apart)
    and a drafted depth against one draft call (goal <= 1.3x)."""
    lines = ["| method | ms/token vs generate | plan + walk + commit + loop ms/step | "
             "of it output projection | drafted depth vs draft call |", "|---|---|---|---|---|"]
    for r in rows:
        book = f"{r['bookkeeping_ms']:.1f}" if "bookkeeping_ms" in r else "–"
        proj = f"{r['projection_ms']:.1f}" if "projection_ms" in r else "–"
        depth = f"{r['depth_vs_head_forward']:.2f}x" if "depth_vs_head_forward" in r else "–"
        vs = f"{r['ms_per_token'] / ar_ms:.3f}x" if r["method"] == "autoregressive" else "–"
        lines.append(f"| {r['method']} | {vs} | {book} | {proj} | {depth} |")
    return "\n".join(lines)


@torch.no_grad()
def forward_curve(model, context_ids: Sequence[int], sizes: Sequence[int], repeats: int) -> list[dict]:
    """Median ms of one target forward that appends ``n`` new tokens to a cache holding
    ``context_ids``, for each ``n`` in ``sizes``: the decoder stack alone, and the
    output projection of all ``n`` rows (what autoregressive/HF decoding pays; rheoplan
    projects only the rows the verifier visits). Same code path as the verify forward
    (``run_base`` with a 4D mask); the cache is cropped back after every call."""
    base, head = base_model(model), output_head(model)
    dev = next(model.parameters()).device
    n0 = len(context_ids)
    cache = new_cache(model)
    run_base(base, cache, torch.tensor(list(context_ids), device=dev), torch.arange(n0, device=dev),
             torch.ones(n0, n0, dtype=torch.bool, device=dev).tril())
    rows = []
    for n in sizes:
        tok = torch.tensor([context_ids[i % n0] for i in range(n)], device=dev)
        pos = torch.arange(n0, n0 + n, device=dev)
        allowed = prefix_and_block_mask(n0, torch.ones(n, n, dtype=torch.bool, device=dev).tril())
        stack, proj = [], []
        for r in range(repeats + 1):  # the first call warms up kernels for this shape
            t0 = time.perf_counter()
            hidden = run_base(base, cache, tok, pos, allowed)
            t1 = time.perf_counter()
            head(hidden)
            t2 = time.perf_counter()
            crop_cache(cache, n0)
            if r:
                stack.append(t1 - t0)
                proj.append(t2 - t1)
        assert cache_length(cache) == n0
        rows.append({"tokens": n, "stack_ms": 1e3 * statistics.median(stack),
                     "head_ms": 1e3 * statistics.median(proj)})
    return rows


def _check_args(args) -> None:
    """Every bad value raises before the model loads."""
    check_run_args(args.tokens, args.threads)
    if args.repeats < 1:
        raise ValueError(f"--repeats={args.repeats}: allowed >= 1")
    if not 1 <= args.context <= 4096:
        raise ValueError(f"--context={args.context}: allowed [1, 4096]")
    bad = [n for n in args.sizes if not 1 <= n <= 256]
    if bad:
        raise ValueError(f"--sizes={args.sizes}: each must be in [1, 256] (got {bad})")
    SamplingConfig(temperature=args.temperature)


def report(rows: list[dict], curve: list[dict], ar_ms: float) -> str:
    """The two tables as markdown."""
    head = ["| method | tau | " + " | ".join(PHASES + ("other",)) + " | ms/step | ms/token | "
            "break-even tau | tau for 1.3x |",
            "|---" * (len(PHASES) + 7) + "|"]
    head.append(f"| ar-hf (generate) | 1.00 | {' | '.join(['–'] * (len(PHASES) + 1))} | {ar_ms:.1f} | "
                f"{ar_ms:.1f} | 1.00 | 1.30 |")
    for r in rows:
        ph = " | ".join(f"{r['phase_ms'][k]:.1f}" for k in PHASES + ("other",))
        head.append(f"| {r['method']} | {r['tau']:.2f} | {ph} | {r['step_ms']:.1f} | {r['ms_per_token']:.1f} | "
                    f"{r['break_even_tau']:.2f} | {r['tau_for_1_3x']:.2f} |")
    one = curve[0]["stack_ms"] if curve and curve[0]["tokens"] == 1 else None
    cur = ["| new tokens | decoder stack ms | output projection ms (all rows) | stack vs 1 token |",
           "|---|---|---|---|"]
    for c in curve:
        rel = f"{c['stack_ms'] / one:.2f}x" if one else "–"
        cur.append(f"| {c['tokens']} | {c['stack_ms']:.1f} | {c['head_ms']:.1f} | {rel} |")
    return "\n".join(head) + "\n\n" + "\n".join(cur)


def _plot(rows: list[dict], curve: list[dict], ar_ms: float, path: Path, what: str = "SmolLM2-135M, CPU") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.8), gridspec_kw={"width_ratios": [3, 2]})
    names = [r["method"] for r in rows]
    left = [0.0] * len(rows)
    for k in PHASES + ("other",):
        vals = [r["phase_ms"][k] / r["tau"] for r in rows]
        ax.barh(names, vals, left=left, label=k)
        left = [a + b for a, b in zip(left, vals)]
    ax.axvline(ar_ms, color="k", ls="--", lw=1)
    ax.text(ar_ms, len(rows) - 0.5, f" generate {ar_ms:.0f} ms", va="center", fontsize=8)
    ax.axvline(ar_ms / 1.3, color="g", ls=":", lw=1)
    ax.text(ar_ms / 1.3, -0.6, "1.3x goal ", ha="right", va="center", fontsize=8, color="g")
    for i, r in enumerate(rows):
        ax.text(left[i], i, f" tau {r['tau']:.2f}, break-even {r['break_even_tau']:.2f}", va="center", fontsize=8)
    ax.set_xlim(0, max(left + [ar_ms]) * 1.6)
    ax.invert_yaxis()
    ax.set_xlabel("ms per emitted token (a step's phases / tau)")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=len(PHASES) + 1)
    ax.set_title(f"Where the time goes ({what})")
    n = [c["tokens"] for c in curve]
    bx.plot(n, [c["stack_ms"] for c in curve], "o-", label="decoder stack")
    bx.plot(n, [c["stack_ms"] + c["head_ms"] for c in curve], "s--", label="+ projection of every row")
    bx.set_xscale("log", base=2)
    bx.set_xlabel("new tokens in one target forward")
    bx.set_ylabel("ms")
    bx.set_ylim(bottom=0)  # a zero baseline: the ratio to one token is what matters
    bx.legend(fontsize=8)
    bx.set_title("Target forward cost vs tokens verified")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="rheoplan bench cost", description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=8, help="held-out prompts (default 8)")
    ap.add_argument("--tokens", type=int, default=24, help="new tokens per prompt (default 24)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--context", type=int, default=200, help="cached tokens for the forward curve (default 200)")
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 8, 9, 16, 32],
                    help="new-token counts for the forward curve")
    ap.add_argument("--repeats", type=int, default=5, help="timed repeats per forward size (default 5)")
    for k in ("depth", "frontier", "slots", "budget"):
        ap.add_argument(f"--{k}", type=int, default=FIXED_TREE[k])
    ap.add_argument("--draft", default="auto", help="as for rheoplan generate (default auto)")
    add_dtype(ap)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--out", default="bench_out", help="where cost.json and cost.png go (default bench_out)")
    args = ap.parse_args(argv)
    _check_args(args)
    methods = methods_for(args.depth, args.frontier, args.slots, args.budget)  # validates the tree
    prompts = load_prompts(args.prompts)
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    model, tok, draft = load_default(method="rheo", draft=args.draft, dtype=args.dtype,
                                      draft_dtype=args.draft_dtype)
    todo = [(methods["ar-hf"], draft), (Method("autoregressive", methods["eagle"].tree), None)]
    todo += [(methods[m], draft) for m in TREE_METHODS]
    records = {}
    # the cost model's latencies (measured here once, then cached) for the 'default' method
    cost = load_cost_model(model, tok, draft, methods["default"].tree, draft_id=args.draft, batched=False)
    for method, d in tqdm(todo, desc="cost: warm-up", unit="method"):
        run_one(model, tok, d, method, prompts[:1], args.temperature, args.seed + 1, 4, cost_model=cost)
    # every method decodes each prompt before the next prompt starts (interleaved)
    for rec in run_group(model, tok, todo, prompts, args.temperature, args.seed, args.tokens, cost_model=cost):
        records[rec["method"]] = rec
    ar = records.pop("ar-hf")
    ar_ms = 1e3 * ar["seconds"] / ar["tokens"]
    rows = [breakdown(r, ar_ms) for r in records.values()]
    context = encode_prompt(tok, prompts[0][1], chat=True)
    context = [context[i % len(context)] for i in range(args.context)]
    curve = forward_curve(model, context, args.sizes, args.repeats)

    print(f"\nSmolLM2-135M, {len(prompts)} held-out prompts x {args.tokens} tokens, T={args.temperature}, "
          f"torch threads {torch.get_num_threads()}, tree depth {args.depth} / frontier {args.frontier} / "
          f"slots {args.slots} / budget {args.budget}; ms per step unless noted\n")
    text = report(rows, curve, ar_ms) + "\n\nLean-step checks (goals: <= 1.03x, <= 4 ms, <= 1.3x):\n\n" + \
        lean_checks(rows, ar_ms)
    print(text)
    (out / "cost.json").write_text(json.dumps({"args": vars(args), "ar_ms_per_token": ar_ms, "ar": ar,
                                               "records": records, "rows": rows, "curve": curve}, indent=1))
    (out / "cost.md").write_text(text + "\n")
    try:
        _plot(rows, curve, ar_ms, out / "cost.png",
              what=f"SmolLM2-135M {model_dtype(model)}, {torch.get_num_threads()} CPU threads")
    except Exception as exc:  # the picture is a convenience; the tables are the result
        print(f"(plot skipped: {exc})", file=sys.stderr)
    print(f"\nwrote {out}/cost.json, cost.md, cost.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
