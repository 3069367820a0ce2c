"""Batched decoding side by side on SmolLM2-135M-Instruct (``rheoplan bench batch``).

For each batch size B (``--batch-sizes``, default 1 4 16), temperature and seed, the same
``--prompts`` held-out prompts (mixed categories, never used in training) are split into
batches of B rows, and each batch is decoded by every method in turn (interleaved: the
method that goes first rotates from batch to batch and from seed to seed, so a machine
that slows down slows every method alike, also where one batch holds every prompt):

* ``generate``: transformers ``generate`` on the batch left-padded with an attention mask
  (dynamic cache, eager), as a transformers user batches;
* ``rowwise``: rheoplan's batch-1 loop, ``plan_and_decode`` with one prompt, over the
  batch's rows one after the other;
* ``batched``: rheoplan's batched loop, ``plan_and_decode`` with the batch's list of
  prompts (one verify forward per step for all rows);
* ``queued`` (only when asked for): rheoplan's batched loop over every prompt at once
  with at most B rows live (``max_batch_size=B``: continuous batching, the next prompt
  takes a finished row's place), timed once per seed and batch size, halfway through
  the batches of the other methods. Rows that accept more finish first; in a batch of B
  the last steps then carry a few rows at nearly the price of all of them, in a queue
  the next prompt joins.

Both rheoplan methods do what ``rheoplan generate`` does by default: RheoSampling (m = 1,
``ot``) with the cost model planning every tree (``--depth auto --budget auto``; the
cost model prices the batch's verify forward at the live rows, so its trees shrink as B
grows). Every row generates exactly ``--tokens`` new tokens (``generate`` with
``min_new_tokens``; rheoplan without an EOS stop), so every method emits the same tokens.

Reported per (dtype, temperature, B, method): tokens/s (generated tokens / wall seconds,
prefill included), the speed-up against ``generate`` at the same B, the mean accepted
length per row (a row's tokens / its steps, averaged over rows), and the tree per batch
size: the cost model's a-priori plan (``CostModel.plan_rows`` from the head's prior at
that temperature: depth, width and per-row budget, the shape several live rows draft
until their own rates take over; a static batch's for its slowest row, ``queued``'s for
the average row while prompts wait to join) next to what the steps kept (mean drafted nodes per
row per drafted step, and the share of steps that drafted at all). ``--plot`` draws throughput against batch size.

    rheoplan bench batch --batch-sizes 1 4 16 --tokens 64 --temperatures 1 0 --plot
"""

from __future__ import annotations

import argparse
import json
from contextlib import nullcontext
import math
import statistics
import sys
import time
from pathlib import Path

import torch

from rheoplan.bench.decode import load_prompts, machine_info, per_seed_note
from rheoplan.config import SamplingConfig, TreeConfig
from rheoplan.decode import plan_and_decode
from rheoplan.loading import DRAFT_DTYPES, auto_tree, encode_prompt, load_cost_model, load_default, model_dtype
from rheoplan.models.packed_linear import unpacked as unpacked_weights
from rheoplan.probe import batched_decode_unavailable

#: ``generate`` runs on the loaded model (linear weights packed where the loader packed
#: them: the fastest ``generate``, the speed-ups' baseline); ``generate-unpacked`` on the
#: weights as transformers loads them (what a user has without rheoplan)
METHODS = ("generate", "generate-unpacked", "rowwise", "batched", "queued")
#: what ``--methods`` runs by default
DEFAULT_METHODS = ("generate", "generate-unpacked", "rowwise", "batched")
#: prompts in rheoplan/data/prompts_heldout.txt (``load_prompts`` checks the range too)
HELDOUT_PROMPTS = 40
#: the plot's default path (small PNG, linked from docs/results.md)
PLOT_PATH = Path("docs/img/bench_batch_throughput.png")
#: the rheoplan methods' largest tree: what ``rheoplan generate`` plans within by default
DEFAULT_TREE = auto_tree(TreeConfig(frontier=3, slots=3, rheostat=1, verifier="rheo"), "auto", "auto")


class BatchedDecodeUnavailable(ValueError):
    """``plan_and_decode`` of this install does not take a list of prompts."""


def check_batched_decode() -> None:
    """Raise ``BatchedDecodeUnavailable`` unless ``plan_and_decode`` decodes a list of
    prompts into one ``DecodeResult`` per row (``rheoplan.probe.batched_decode_unavailable``:
    tried on a tiny functional model, before any SmolLM2 work)."""
    why = batched_decode_unavailable()
    if why is not None:
        raise BatchedDecodeUnavailable(
            "--methods batched needs plan_and_decode to accept a list of prompts (batched decoding, "
            f"issue 15), and this rheoplan's does not ({why}); run --methods generate rowwise")


def check_args(args) -> None:
    """Every flag's range, before any model loads (each error names its flag)."""
    sizes = args.batch_sizes
    if not sizes or any(b < 1 for b in sizes):
        raise ValueError(f"--batch-sizes={sizes}: allowed ints >= 1")
    if len(set(sizes)) != len(sizes):
        raise ValueError(f"--batch-sizes={sizes}: each batch size once")
    if args.tokens < 1:
        raise ValueError(f"--tokens={args.tokens}: allowed >= 1")
    if args.prompts is not None:
        bad = [b for b in sizes if args.prompts % b]
        if bad:
            raise ValueError(f"--prompts={args.prompts} is not a multiple of --batch-sizes {bad}: every batch "
                             "size splits the same prompts into whole batches")
    if not args.temperatures:
        raise ValueError("--temperatures: allowed one or more values >= 0")
    for t in args.temperatures:
        try:
            SamplingConfig(temperature=t)
        except ValueError as exc:
            raise ValueError(f"--temperatures: {exc}") from None
    if not args.seeds or any(s < 0 for s in args.seeds):
        raise ValueError(f"--seeds={args.seeds}: allowed ints >= 0")
    if not args.methods or len(set(args.methods)) != len(args.methods):
        raise ValueError(f"--methods={args.methods}: allowed each of {', '.join(METHODS)} at most once")
    if "queued" in args.methods and "generate" not in args.methods:
        raise ValueError("--methods queued: the speed-ups are against generate; add generate")
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads={args.threads}: allowed >= 1")


def default_prompts(sizes) -> int:
    """The fewest prompts that split into whole batches of every size and give the largest
    size two batches (32 for 1 4 16), or one where the held-out set has too few prompts
    for two (their least common multiple). With one batch per seed, one slow spell of the
    machine during one method's decode of it moved a seed's speed-up at 16 rows by 30%
    (docs/results.md, "Nineteenth measurement"; with two, the "Twentieth" read every seed
    within 1.14-1.22x)."""
    n = math.lcm(*sizes)
    if n > HELDOUT_PROMPTS:
        raise ValueError(f"--batch-sizes={list(sizes)}: whole batches of every size need a multiple of {n} "
                         f"prompts, more than the {HELDOUT_PROMPTS} held-out ones; pick sizes whose least "
                         f"common multiple is at most {HELDOUT_PROMPTS}")
    two = n * math.ceil(2 * max(sizes) / n)
    return two if two <= HELDOUT_PROMPTS else n


def left_pad(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)`` ``[B, longest]`` with every row padded on the left,
    as ``generate`` wants a decoder-only batch.

    Example: [[5, 6], [7]] with pad 0 -> ids [[5, 6], [0, 7]], mask [[1, 1], [0, 1]].
    """
    n = max(len(r) for r in rows)
    ids = torch.full((len(rows), n), pad_id, dtype=torch.int64)
    mask = torch.zeros((len(rows), n), dtype=torch.int64)
    for i, r in enumerate(rows):
        ids[i, n - len(r):] = torch.tensor(r, dtype=torch.int64)
        mask[i, n - len(r):] = 1
    return ids, mask


def _row_stats(results) -> dict:
    """Per-row accepted length and kept tree size of ``DecodeResult`` objects."""
    taus = [len(r.tokens) / len(r.steps) for r in results if r.steps]
    drafted = [st for r in results for st in r.steps if st.drafted]
    steps = sum(len(r.steps) for r in results)
    return {"row_tau": taus,
            "kept_sum": sum(st.tree_size for st in drafted), "drafted_steps": len(drafted), "steps": steps}


def held_out_groups(model, tok, draft, rows: int, groups: int, tokens: int, temperature: float):
    """``run(k)``: group ``k`` of ``groups`` groups of held-out prompts decoded as ``rheoplan
    generate`` and the batched loop decode them (``DEFAULT_TREE``, the cost model, seed
    ``k``): one prompt when ``rows == 1``, else a static batch of ``rows``; returns its
    ``DecodeResult`` list. What the paired examples (``examples/measure_*.py``) alternate."""
    prompts = [encode_prompt(tok, p, chat=True) for _, p in load_prompts(rows * groups)]
    cost = load_cost_model(model, tok, draft, DEFAULT_TREE, draft_id="auto")
    sampling = SamplingConfig(temperature=temperature)

    def run(k: int) -> list:
        batch = prompts[k] if rows == 1 else prompts[rows * k:rows * k + rows]
        res = plan_and_decode(model, draft, batch, max_new_tokens=tokens, sampling=sampling, tree=DEFAULT_TREE,
                              seed=k, cost_model=cost)
        return [res] if rows == 1 else res

    return run


def run_generate(model, pad_id: int, rows: list[list[int]], temperature: float, seed: int, tokens: int,
                 unpacked: bool = False) -> dict:
    """``generate`` on the left-padded batch; exactly ``tokens`` new tokens per row.
    ``unpacked``: on the linear weights as transformers loads them (packed again after)."""
    ids, mask = left_pad(rows, pad_id)
    torch.manual_seed(seed)
    kw = dict(do_sample=True, temperature=temperature) if temperature > 0 else dict(do_sample=False)
    with unpacked_weights(model) if unpacked else nullcontext():
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=tokens, min_new_tokens=tokens, top_k=0,
                                 top_p=1.0, pad_token_id=pad_id, **kw)
        seconds = time.perf_counter() - t0
    new = (out.shape[1] - ids.shape[1]) * len(rows)
    return {"tokens": new, "seconds": seconds, "row_tau": [1.0] * len(rows), "kept_sum": 0, "drafted_steps": 0,
            "steps": new}


def run_rowwise(model, draft, rows, temperature: float, seed: int, tokens: int, cost, tree: TreeConfig) -> dict:
    """rheoplan's batch-1 loop over the rows one after the other (row ``i`` seeds ``seed + i``)."""
    sampling = SamplingConfig(temperature=temperature)
    results = []
    t0 = time.perf_counter()
    for i, ids in enumerate(rows):
        results.append(plan_and_decode(model, draft, ids, max_new_tokens=tokens, sampling=sampling, tree=tree,
                                       seed=seed + i, cost_model=cost))
    seconds = time.perf_counter() - t0
    return {"tokens": sum(len(r.tokens) for r in results), "seconds": seconds, **_row_stats(results)}


def run_batched(model, draft, rows, temperature: float, seed: int, tokens: int, cost, tree: TreeConfig,
                max_batch_size: int | None = None) -> dict:
    """rheoplan's batched loop: one ``plan_and_decode`` over the list of rows, all of them
    live at once, or at most ``max_batch_size`` (``queued``: continuous batching)."""
    sampling = SamplingConfig(temperature=temperature)
    live = None if max_batch_size is None else min(max_batch_size, len(rows))
    t0 = time.perf_counter()
    results = plan_and_decode(model, draft, [list(r) for r in rows], max_new_tokens=tokens, sampling=sampling,
                              tree=tree, seed=seed, cost_model=cost, max_batch_size=live)
    seconds = time.perf_counter() - t0
    if not isinstance(results, list) or len(results) != len(rows):
        raise BatchedDecodeUnavailable(f"plan_and_decode returned {type(results).__name__} for {len(rows)} rows")
    return {"tokens": sum(len(r.tokens) for r in results), "seconds": seconds, **_row_stats(results)}


def run_batch_size(model, pad_id: int, draft, prompts: list[list[int]], batch: int, temperature: float, seed: int,
                   tokens: int, methods, cost, tree: TreeConfig) -> list[dict]:
    """Every method over ``prompts`` split into batches of ``batch`` rows, interleaved
    (batch ``k`` of seed ``s`` starts with method ``(k + s) mod len(methods)``: with one
    batch per seed, the seeds still rotate the order); ``queued`` over every prompt at
    once, halfway through the batches. One record per method."""
    acc = {m: {"tokens": 0, "seconds": 0.0, "row_tau": [], "kept_sum": 0, "drafted_steps": 0, "steps": 0}
           for m in methods}
    queued = "queued" in methods
    methods = [m for m in methods if m != "queued"]
    half = (len(prompts) // batch) // 2 * batch
    for k in range(0, len(prompts), batch):
        if queued and k == half:
            r = run_batched(model, draft, prompts, temperature, seed * 1000, tokens, cost, tree, max_batch_size=batch)
            a = acc["queued"]
            for key in ("tokens", "seconds", "kept_sum", "drafted_steps", "steps"):
                a[key] += r[key]
            a["row_tau"] += r["row_tau"]
        if not methods:
            continue
        rows = prompts[k:k + batch]
        j = (k // batch + seed) % len(methods)
        bseed = seed * 1000 + k
        for m in methods[j:] + methods[:j]:
            if m.startswith("generate"):
                r = run_generate(model, pad_id, rows, temperature, bseed, tokens, unpacked=m == "generate-unpacked")
            elif m == "rowwise":
                r = run_rowwise(model, draft, rows, temperature, bseed, tokens, cost, tree)
            else:
                r = run_batched(model, draft, rows, temperature, bseed, tokens, cost, tree)
            a = acc[m]
            for key in ("tokens", "seconds", "kept_sum", "drafted_steps", "steps"):
                a[key] += r[key]
            a["row_tau"] += r["row_tau"]
    out = []
    for m, a in acc.items():
        out.append({"method": m, "batch_size": batch, "temperature": temperature, "seed": seed,
                    "prompts": len(prompts), "tokens": a["tokens"], "seconds": a["seconds"],
                    "tokens_per_second": a["tokens"] / a["seconds"] if a["seconds"] else float("nan"),
                    "mean_accepted_length": statistics.mean(a["row_tau"]) if a["row_tau"] else float("nan"),
                    "kept_per_row": a["kept_sum"] / a["drafted_steps"] if a["drafted_steps"] else 0.0,
                    "drafted_share": a["drafted_steps"] / a["steps"] if a["steps"] else 0.0})
    return out


#: new tokens per row of each untimed warm-up batch
WARM_TOKENS = 4


def warm_up(model, pad_id: int, draft, prompts: list[list[int]], sizes, temperatures, methods, cost,
            tree: TreeConfig) -> None:
    """Untimed, before the first timed batch: one short batch (``WARM_TOKENS`` per row) of
    every batch size, temperature and method (``prompts`` holds at least the largest
    size). The first batch of a shape can pay what later ones do not (oneDNN builds its
    kernels for the shape, the allocator grows to the largest batch, numba compiles); the
    warm-up used to be one 2-row batch, and in the eighteenth measurement of
    docs/results.md the first seed read the lowest speed-up at every size (0.90x at 4
    rows against 1.03x and 1.27x), whether from that or from the machine's drift."""
    for t in temperatures:
        for b in sizes:
            run_batch_size(model, pad_id, draft, prompts[:b], b, t, 0, WARM_TOKENS, methods, cost, tree)


def summarise(records: list[dict]) -> list[dict]:
    """Median over seeds per (dtype, temperature, batch size, method), with the speed-up
    against ``generate``'s median at the same dtype, temperature and batch size, and per
    seed against ``generate``'s run of that seed (``speedup_seeds``, in seed order: the
    same batches, timed interleaved with it)."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault((r["dtype"], r["temperature"], r["batch_size"], r["method"]), []).append(r)
    gen = {k[:3]: statistics.median(x["tokens_per_second"] for x in rs)
           for k, rs in groups.items() if k[3] == "generate"}
    gen_seed = {(*k[:3], x["seed"]): x["tokens_per_second"]
                for k, rs in groups.items() if k[3] == "generate" for x in rs}
    order = {m: i for i, m in enumerate(METHODS)}
    rows = []
    for (d, t, b, m), rs in sorted(groups.items(), key=lambda kv: (kv[0][0], -kv[0][1], kv[0][2], order[kv[0][3]])):
        tps = statistics.median(x["tokens_per_second"] for x in rs)
        rows.append({"dtype": d, "temperature": t, "batch_size": b, "method": m, "seeds": len(rs),
                     "tokens_per_second": tps, "tps_min": min(x["tokens_per_second"] for x in rs),
                     "tps_max": max(x["tokens_per_second"] for x in rs),
                     "speedup": tps / gen[d, t, b] if (d, t, b) in gen else float("nan"),
                     "speedup_seeds": tuple(x["tokens_per_second"] / gen_seed[d, t, b, x["seed"]]
                                            for x in sorted(rs, key=lambda x: x["seed"])
                                            if (d, t, b, x["seed"]) in gen_seed),
                     "mean_accepted_length": statistics.median(x["mean_accepted_length"] for x in rs),
                     "kept_per_row": statistics.median(x["kept_per_row"] for x in rs),
                     "drafted_share": statistics.median(x["drafted_share"] for x in rs),
                     "plan": rs[0].get("plan")})
    return rows


def report(rows: list[dict], machine: dict | None = None) -> str:
    """The markdown table (docs/results.md style)."""
    lines = []
    if machine:
        lines += [f"Machine: {machine['cpu']}; {machine['threads']} torch threads of {machine['cores']} cores; "
                  f"torch {machine['torch']}, transformers {machine['transformers']}.", ""]
    lines += ["| dtype | T | batch | method | seeds | tokens/s | speed-up vs generate | mean accepted length per row "
              "| tree: planned depth / width / budget per row | tree: kept nodes per row (drafted steps) |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        tps = f"{r['tokens_per_second']:.1f}"
        if r["seeds"] > 1 and r["tps_min"] != r["tps_max"]:
            tps += f" ({r['tps_min']:.1f}–{r['tps_max']:.1f})"
        if r["method"].startswith("generate"):
            planned = kept = "–"
        else:
            p = r.get("plan") or {}
            planned = f"{p['depth']} / {p.get('width', 1)} / {p['budget']}" if p else "–"
            kept = f"{r['kept_per_row']:.2f} ({100 * r['drafted_share']:.0f}% of steps)"
        speed = "–" if r["speedup"] != r["speedup"] else f"{r['speedup']:.2f}x"
        if r["method"] != "generate":
            speed += per_seed_note(r.get("speedup_seeds"))
        lines.append(f"| {r['dtype']} | {r['temperature']} | {r['batch_size']} | {r['method']} | {r['seeds']} | "
                     f"{tps} | {speed} | {r['mean_accepted_length']:.2f} | {planned} | {kept} |")
    return "\n".join(lines)


#: the speed-ups ``needs_table`` asks the cost model about: drafting gaining 5%, and 1.3x
NEED_SPEEDUPS = (1.05, 1.3)


def needs_table(needs: dict) -> str:
    """Per batch size, the per-depth continuation rate a head needs for each speed-up over
    plain steps, by the cost model with this machine's latencies
    (``CostModel.needed_continuation``): ``{batch: {"1.3x": (rate, depth) or None}}``."""
    heads = list(next(iter(needs.values())))
    lines = ["What a head must accept for each speed-up over plain autoregressive steps (the cost model "
             "with the latencies measured here; rate = share of the walks that go on at every depth):", "",
             "| batch | " + " | ".join(f"{h}: rate (depth)" for h in heads) + " |",
             "|---|" + "---|" * len(heads)]
    for b, row in needs.items():
        cells = ["out of reach" if v is None else f"{v[0]:.2f} ({v[1]})" for v in row.values()]
        lines.append(f"| {b} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> Path:
    """Throughput against batch size, one line per method, one panel per (dtype, T)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = list(dict.fromkeys((r["dtype"], r["temperature"]) for r in rows))
    fig, axes = plt.subplots(1, len(panels), figsize=(3.6 * len(panels), 3.0), squeeze=False)
    for ax, (d, t) in zip(axes[0], panels):
        for m in METHODS:
            pts = sorted((r["batch_size"], r["tokens_per_second"]) for r in rows
                         if (r["dtype"], r["temperature"], r["method"]) == (d, t, m))
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=m)
        ax.set_xscale("log", base=2)
        sizes = sorted({r["batch_size"] for r in rows})
        ax.set_xticks(sizes, [str(b) for b in sizes])
        ax.minorticks_off()
        ax.set_xlabel("batch size")
        ax.set_ylabel("tokens/s")
        ax.set_title(f"{d}, T={t}", fontsize=9)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle("SmolLM2-135M: throughput vs batch size", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="rheoplan bench batch", description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16], help="rows per batch (default 1 4 16)")
    ap.add_argument("--prompts", type=int, default=None,
                    help="held-out prompts, split into batches of every size (a multiple of every batch size, "
                         "at most 40; default: the fewest that give the largest size two batches, 32 for 1 4 16, "
                         "or the least common multiple of the sizes where 40 are too few)")
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per row (default 64)")
    ap.add_argument("--temperatures", type=float, nargs="+", default=[1.0, 0.0], help="default 1 0")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0], help="default 0")
    ap.add_argument("--methods", nargs="+", choices=METHODS, default=list(DEFAULT_METHODS),
                    help="default: all but queued")
    ap.add_argument("--draft", default="auto", help="as for rheoplan generate (default auto)")
    ap.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                    help="target dtype (default auto: the one measured fastest here)")
    ap.add_argument("--draft-dtype", choices=DRAFT_DTYPES, default="auto",
                    help="the draft head's dtype, as for rheoplan generate (default auto)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--out", default="bench_batch_out", help="JSON records and the markdown table (default "
                                                              "bench_batch_out)")
    ap.add_argument("--plot", nargs="?", const=str(PLOT_PATH), default=None, metavar="PNG",
                    help=f"draw throughput vs batch size (default path {PLOT_PATH})")
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    check_args(args)
    if args.prompts is None:
        args.prompts = default_prompts(args.batch_sizes)
    texts = load_prompts(args.prompts)
    if set(args.methods) & {"batched", "queued"}:
        check_batched_decode()
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    model, tok, draft = load_default(method="rheo", draft=args.draft, dtype=args.dtype,
                                      draft_dtype=args.draft_dtype)
    dtype = model_dtype(model)
    pad_id = tok.eos_token_id if tok.eos_token_id is not None else 0
    prompts = [encode_prompt(tok, p, chat=True) for _, p in texts]
    tree = DEFAULT_TREE
    cost = None
    if set(args.methods) & {"rowwise", "batched", "queued"}:
        cost = load_cost_model(model, tok, draft, tree, draft_id=args.draft)
    ctx = int(statistics.mean(len(p) for p in prompts)) + args.tokens // 2
    # the a-priori plan per (temperature, batch size, prompts waiting to join), from the head's
    # prior at that temperature: a static batch plans for its slowest row, a queue for the average
    plans = {(t, b, w): cost.plan_rows(b, ctx=ctx, max_depth=tree.depth, max_width=min(tree.frontier, tree.budget),
                                       calibration=cost.fresh_calibration(t), rows_waiting=w).as_dict() if cost else None
             for t in args.temperatures for b in args.batch_sizes for w in (False, True)}
    needs = {b: {f"{x}x": cost.needed_continuation(b, x, ctx=ctx, max_depth=tree.depth) for x in NEED_SPEEDUPS}
             for b in args.batch_sizes} if cost else {}
    warm_up(model, pad_id, draft, prompts, args.batch_sizes, args.temperatures, args.methods, cost, tree)
    machine = machine_info()
    records = []
    for t in args.temperatures:
        for s in args.seeds:
            for b in args.batch_sizes:
                print(f"bench batch: {dtype} T={t} seed={s} batch={b} ...", file=sys.stderr, flush=True)
                for rec in run_batch_size(model, pad_id, draft, prompts, b, t, s, args.tokens, args.methods,
                                          cost, tree):
                    rec.update(dtype=dtype, plan=plans[(t, b, rec["method"] == "queued")], tokens_per_row=args.tokens,
                               draft_dtype=model_dtype(draft.head) if hasattr(draft, "head") else None)
                    records.append(rec)
    rows = summarise(records)
    table = report(rows, machine) + ("\n\n" + needs_table(needs) if needs else "")
    named = {f"T={t:g} B={b}" + (" waiting" if w else ""): p for (t, b, w), p in plans.items()}
    (out / "bench_batch.json").write_text(json.dumps({"machine": machine, "plans": named, "needed_continuation": needs,
                                                      "records": records, "summary": rows}, indent=1))
    (out / "bench_batch.md").write_text(table + "\n")
    print(table)
    print(f"\nrecords in {out / 'bench_batch.json'}, table in {out / 'bench_batch.md'}")
    if args.plot:
        print(f"plot: {plot(rows, Path(args.plot))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
