"""Requests of different lengths: ``generate`` in padded batches against rheoplan's batched
loop in the same batches and as continuous batching.

A server's requests ask for different numbers of new tokens and stop at EOS.
transformers ``generate`` takes one ``max_new_tokens`` per call, so a padded batch runs
until its longest request is done or every row has reached EOS, and the shorter requests'
extra tokens are thrown away. rheoplan takes one budget per row, and a row that is done
leaves the batch; with ``max_batch_size`` a waiting request takes its place (continuous
batching: one ``plan_and_decode`` over every request). Three ways to serve the same
held-out prompts, each request with a budget drawn once (``--min-tokens`` to
``--max-tokens``, seeded) and EOS on:

* ``generate``: batches of ``--batch-size`` requests in order, left-padded, each call with
  its batch's largest budget; each row's output cut to its own budget and EOS;
* ``batched``: rheoplan on the same batches (per-row budgets, EOS);
* ``continuous``: rheoplan over all requests at once, ``max_batch_size=--batch-size``.

The rheoplan methods run as ``rheoplan generate`` does by default (RheoSampling with the
cost model). Prints, per round (the order of the methods rotating) and as medians: the
tokens the requests asked for and got (up to their budget and EOS) per second of wall
time, the wall time to serve them all, and each request's latency: every request arrives
at the start, so its latency is when its tokens are complete (``generate``: when its
batch's call returns; rheoplan: its row's ``DecodeResult.seconds``, plus the start of its
batch for fixed batches), as the median and the 90th percentile over the requests.

    python examples/serve_mixed_lengths.py --requests 16 --batch-size 4 --min-tokens 16 --max-tokens 96 --rounds 3
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

METHODS = ("generate", "batched", "continuous")


def cut(tokens: list[int], budget: int, eos: set[int]) -> list[int]:
    """A request's tokens: at most ``budget``, ending at the first EOS (kept): the rule
    rheoplan's decode loop cuts each step's tokens by, applied to ``generate``'s rows."""
    from rheoplan.decode import _cut_emitted

    return _cut_emitted(tokens, budget, eos)[0]


def percentile(xs: list[float], q: float) -> float:
    """The ``q``-quantile of ``xs`` (linear between order statistics; q in [0, 1])."""
    ys = sorted(xs)
    pos = q * (len(ys) - 1)
    lo = int(pos)
    return ys[lo] + (ys[min(lo + 1, len(ys) - 1)] - ys[lo]) * (pos - lo)


def serve_generate(model, prompts, budgets, batch, temperature, seed, pad_id, eos) -> tuple[int, list[float]]:
    """``generate`` over batches of ``batch`` requests; returns the requests' tokens and
    each request's latency (s from the start)."""
    from rheoplan.bench.batch import left_pad

    got, latency, t0 = 0, [], time.perf_counter()
    for k in range(0, len(prompts), batch):
        ids, mask = left_pad(prompts[k:k + batch], pad_id)
        torch.manual_seed(seed + k)
        kw = dict(do_sample=True, temperature=temperature) if temperature > 0 else dict(do_sample=False)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=max(budgets[k:k + batch]), top_k=0,
                                 top_p=1.0, pad_token_id=pad_id, eos_token_id=sorted(eos), **kw)
        done = time.perf_counter() - t0
        for i, row in enumerate(out[:, ids.shape[1]:].tolist()):
            got += len(cut(row, budgets[k + i], eos))
            latency.append(done)
    return got, latency


def serve_rheoplan(model, draft, prompts, budgets, batch, temperature, seed, eos, cost, tree,
                   continuous) -> tuple[int, list[float]]:
    """rheoplan's batched loop over the same batches, or over every request at once; returns
    the requests' tokens and each request's latency (s from the start)."""
    from rheoplan.config import SamplingConfig
    from rheoplan.decode import plan_and_decode

    sampling = SamplingConfig(temperature=temperature)
    groups = [(0, len(prompts))] if continuous else [(k, min(k + batch, len(prompts)))
                                                     for k in range(0, len(prompts), batch)]
    got, latency, t0 = 0, [], time.perf_counter()
    for a, b in groups:
        start = time.perf_counter() - t0
        res = plan_and_decode(model, draft, [list(p) for p in prompts[a:b]], max_new_tokens=list(budgets[a:b]),
                              sampling=sampling, tree=tree, seed=seed + a, eos_token_id=sorted(eos),
                              cost_model=cost, max_batch_size=batch)
        for r, budget in zip(res, budgets[a:b]):
            if len(cut(r.tokens, budget, eos)) != len(r.tokens):
                raise AssertionError("rheoplan emitted past a request's budget or EOS")
            got += len(r.tokens)
            latency.append(start + r.seconds)
    return got, latency


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=16, help="held-out prompts served (1-40; default 16)")
    ap.add_argument("--batch-size", type=int, default=4, help="rows decoding at once (>= 1; default 4)")
    ap.add_argument("--min-tokens", type=int, default=16, help="smallest budget (>= 1; default 16)")
    ap.add_argument("--max-tokens", type=int, default=96, help="largest budget (>= --min-tokens; default 96)")
    ap.add_argument("--temperature", type=float, default=1.0, help=">= 0; default 1")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of every method (>= 1; default 3)")
    ap.add_argument("--seed", type=int, default=0, help="budgets and draws (default 0)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (>= 1; default 2)")
    args = ap.parse_args(argv)
    for name, lo, hi in (("requests", 1, 40), ("batch_size", 1, None), ("min_tokens", 1, None),
                         ("max_tokens", args.min_tokens, None), ("rounds", 1, None), ("threads", 1, None)):
        v = getattr(args, name)
        if v < lo or (hi is not None and v > hi):
            allowed = f"{lo}..{hi}" if hi is not None else f">= {lo}"
            ap.error(f"--{name.replace('_', '-')}={v} is out of range: allowed {allowed}")
    if args.temperature < 0:
        ap.error(f"--temperature={args.temperature} is out of range: allowed >= 0")
    torch.set_num_threads(args.threads)

    from rheoplan.bench.batch import DEFAULT_TREE
    from rheoplan.bench.decode import load_prompts
    from rheoplan.loading import encode_prompt, load_cost_model, load_default

    model, tok, draft = load_default(method="rheo", draft="auto", dtype="auto")
    cost = load_cost_model(model, tok, draft, DEFAULT_TREE, draft_id="auto")
    prompts = [encode_prompt(tok, p, chat=True) for _, p in load_prompts(args.requests)]
    rng = random.Random(args.seed)
    budgets = [rng.randint(args.min_tokens, args.max_tokens) for _ in prompts]
    e = model.generation_config.eos_token_id
    eos = {e} if isinstance(e, int) else set(e)
    pad = tok.pad_token_id if tok.pad_token_id is not None else min(eos)
    print(f"{len(prompts)} requests, budgets {min(budgets)}-{max(budgets)} (sum {sum(budgets)}), "
          f"batch size {args.batch_size}, T = {args.temperature:g}, EOS {sorted(eos)}", flush=True)
    run = {"generate": lambda s: serve_generate(model, prompts, budgets, args.batch_size, args.temperature, s, pad,
                                                eos),
           "batched": lambda s: serve_rheoplan(model, draft, prompts, budgets, args.batch_size, args.temperature, s,
                                               eos, cost, DEFAULT_TREE, continuous=False),
           "continuous": lambda s: serve_rheoplan(model, draft, prompts, budgets, args.batch_size,
                                                  args.temperature, s, eos, cost, DEFAULT_TREE, continuous=True)}
    serve_generate(model, prompts[:2], budgets[:2], 2, args.temperature, 0, pad, eos)  # warm-up
    serve_rheoplan(model, draft, prompts[:2], [4, 4], 2, args.temperature, 0, eos, cost, DEFAULT_TREE, True)
    rate = {m: [] for m in METHODS}
    wall = {m: [] for m in METHODS}
    p50 = {m: [] for m in METHODS}
    p90 = {m: [] for m in METHODS}
    names = list(METHODS)
    for r in range(args.rounds):
        for m in names[r % 3:] + names[:r % 3]:
            t0 = time.perf_counter()
            got, lat = run[m](args.seed * 1000 + r * 100)
            wall[m].append(time.perf_counter() - t0)
            rate[m].append(got / wall[m][-1])
            p50[m].append(percentile(lat, 0.5))
            p90[m].append(percentile(lat, 0.9))
        print(f"round {r}: " + ", ".join(f"{m} {rate[m][-1]:.1f} tok/s ({wall[m][-1]:.1f} s; latency p50 "
                                         f"{p50[m][-1]:.1f} s, p90 {p90[m][-1]:.1f} s)" for m in names), flush=True)
    base = statistics.median(rate["generate"])
    med = statistics.median
    print("median: " + ", ".join(f"{m} {med(rate[m]):.1f} tok/s, {med(wall[m]):.1f} s, latency p50 {med(p50[m]):.1f} s "
                                 f"/ p90 {med(p90[m]):.1f} s ({med(rate[m]) / base:.2f}x generate)" for m in names))


if __name__ == "__main__":
    main()
