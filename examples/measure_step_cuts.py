"""The twenty-ninth and thirtieth rounds' step cuts against their previous form, in one process.

The twenty-ninth round changed five things in a decode's steps (docs/results.md,
"Twenty-ninth round"):

* a commit moves its accepted cache entries with one numba call per tensor
  (``rheoplan.kernels.cache_moves``) instead of torch's gather and write-back;
* ``distributions.target_probs`` checks unprocessed scores (T = 1, nothing else) on the
  law's first column instead of by a pass over the logits;
* a batched EAGLE-3 draft call runs every pending target feature through ``fc`` in one
  product (``Eagle3Draft._fused_hidden``) instead of one product per pair;
* a greedy batch reads the greedy token of every row's prefetched nodes in one pass
  (``decode._greedy_rows``) instead of one pass per visited node;
* the walk's draw at a node splits its stream over numba's threads
  (``kernels.gumbel.gumbel_max_stream_split``); undone here by giving the node draws one
  range (the split's serial path).

The thirtieth (``--round 30``; docs/results.md, "Thirtieth round"):

* greedy walks of the numba backend take each node's token from a numba scan for the
  first maximum (``rheoplan.kernels.argmax``) instead of torch's ``max`` with indices;
* ``CostModel.plan_rows`` (a batch's tree, every step) reads each latency once for all
  the widths it tries, and the rates of the depths it plans only; ``Timings`` keeps the
  context-free parts of its verify latencies once computed;
* a decode lowers its pass list once (``DecodeState.lowered``) instead of every step;
  undone here by lowering the default list once more before each step's plan (since the
  thirty-fourth round a one-row decode plans with the fused cost pipeline, which lowers
  nothing, so this one is undone for batches of several rows only);
* a greedy batch picks its read rows' tokens on the projection's output as it is
  (``greedy_tokens(rows=)``) instead of on a stack of those rows.

This script switches one round's cuts back to their previous form and forward again
between runs:

* ``--what moves``: the commit's moves alone on SmolLM2-shaped caches (30 layers of keys
  and values ``[rows, 3, width, 64]``, bfloat16, prefix views of larger buffers), kernel
  and reference alternating call by call; prints medians and whether they agree bit for bit.
* ``--what decode``: one-row decodes of held-out prompts as ``rheoplan generate`` runs them,
  alternating prompt by prompt; ``--what batch``: static batches of ``--rows`` prompts,
  alternating batch by batch. Both print tokens/s, ms per step by phase and how many
  prompts / batches got the same tokens (the draft's one product rounds differently from
  its per-pair products, so a batch's trees, and at T > 0 its tokens, may differ: both
  exact; the thirtieth round's cuts change no token).

docs/results.md quotes it:

    python examples/measure_step_cuts.py --what moves [--rows 4] [--calls 200]
    python examples/measure_step_cuts.py --what decode [--prompts 12] [--temperature 1] [--round 29]
    python examples/measure_step_cuts.py --what batch [--rows 4] [--batches 6] [--temperature 1] [--round 29]
"""

from __future__ import annotations

import argparse
import statistics
import time
from contextlib import contextmanager

import torch


def moves(args) -> None:
    from rheoplan.kernels.cache_moves import move_columns, reference

    g = torch.Generator().manual_seed(0)
    width, start = 150, 147
    layers = []
    for _ in range(30):
        bufs = [torch.randn(args.rows, 3, width + 64, 64, generator=g).to(torch.bfloat16) for _ in range(2)]
        layers.append(tuple(b[:, :, :width] for b in bufs))
    paths = [[0, 2][:1 + b % 2] for b in range(args.rows)]  # depth-1 trees: root, then its second child
    copy = [(k.clone(), v.clone()) for k, v in layers]
    move_columns(layers, start, paths)
    reference.move_columns(copy, start, paths)
    same = all(torch.equal(a, b) for p, q in zip(layers, copy) for a, b in zip(p, q))
    times = {"kernel": [], "reference": []}
    for _ in range(args.calls):
        for name, fn in (("kernel", move_columns), ("reference", reference.move_columns)):
            t = time.perf_counter()
            fn(layers, start, paths)
            times[name].append(time.perf_counter() - t)
    med = {k: 1e6 * statistics.median(v[5:]) for k, v in times.items()}
    print(f"{args.rows} rows, 60 tensors: kernel {med['kernel']:.0f} us, reference {med['reference']:.0f} us "
          f"({med['reference'] / med['kernel']:.1f}x); bit-identical: {same}")


def previous_form(on: bool, round_: int):
    """``round_``'s cuts undone while ``on``."""
    return (previous_form_29 if round_ == 29 else previous_form_30)(on)


@contextmanager
def previous_form_30(on: bool):
    """The thirtieth round's cuts undone while ``on``: torch's max with indices for greedy
    picks, ``plan_rows`` as ``plan_for_batch`` at each width (all of it per width, every
    depth's rate), a lowering before each plan, a stack of a greedy batch's read rows."""
    import rheoplan.decode as decode
    import rheoplan.walk as walk
    from rheoplan.costmodel import PLAN_WIDTHS, BatchPlan, CostModel, Timings, interp, slowest_row_tokens
    from rheoplan.kernels.argmax import reference
    from rheoplan.pipeline import lower
    from rheoplan.planner.default import DEFAULT_PIPELINE

    def plan_for_batch(self, batch, ctx, max_depth, width, cont, rows_waiting):  # its loop as it was
        tm = self.timings
        ar_ms = tm.ar_step_batch(batch, ctx)
        best = BatchPlan(batch, 0, 0, 1.0, ar_ms, batch / ar_ms * 1e3, batch / ar_ms * 1e3)
        e, reach = 1.0, 1.0
        for d in range(1, max_depth + 1):
            reach *= float(cont[d - 1])
            e += reach
            cost = (d * tm.draft_batch(batch, width) + tm.verify_batch(batch, 1 + width * d, ctx)
                    + tm.tree_overhead(batch, d, width))
            rate = batch * slowest_row_tokens(e, batch, rows_waiting) / cost * 1e3
            if rate > best.tokens_per_s:
                best = BatchPlan(batch, d, width * d, e, cost, rate, best.ar_tokens_per_s, width)
        return best

    def plan_rows(self, batch, *, ctx, max_depth, max_width, calibration, rows_waiting=False):
        best = None
        for w in range(1, min(max_width, PLAN_WIDTHS) + 1):
            p = plan_for_batch(self, batch, ctx, max_depth, w, list(calibration.continuation(w)), rows_waiting)
            if best is None or p.tokens_per_s > best.tokens_per_s:
                best = p
        return best

    plan_tree = decode.plan_tree

    def lowered_each_step(*args, backend, **kw):  # the lowering every step's plan made
        lower(DEFAULT_PIPELINE, backend)
        return plan_tree(*args, backend=backend, **kw)

    def verify_ends(self, n):  # as it was: computed on every read
        return interp(self.sizes, self.verify_lo, n), interp(self.sizes, self.verify_hi, n)

    def verify_batch(self, batch, row_tokens, ctx):  # as it was
        if batch == 1:
            return self.verify(row_tokens, ctx)
        total = batch * row_tokens
        if not self.batch_sizes:
            return self.verify(total, ctx)
        v = interp(self.batch_sizes, [interp(self.batch_row_sizes, row, row_tokens) for row in self.batch_verify],
                   batch)
        scale = self.batch_tree_scale if row_tokens > 1 else self.batch_ar_scale
        if scale:
            v *= interp(self.batch_sizes, scale, batch)
        v += self.verify(total, ctx) - self.verify(total, self.ctx_lo)
        return max(v, 1e-3)

    saved = (decode.first_max, walk.first_max, CostModel.plan_rows, decode.plan_tree, decode._rows_of_one_block,
             Timings.verify_ends, Timings.verify_batch)
    if on:
        decode.first_max = walk.first_max = reference.first_max
        CostModel.plan_rows = plan_rows
        decode.plan_tree = lowered_each_step
        decode._rows_of_one_block = lambda rows: None  # the stack of the read rows
        Timings.verify_ends, Timings.verify_batch = verify_ends, verify_batch
    try:
        yield
    finally:
        (decode.first_max, walk.first_max, CostModel.plan_rows, decode.plan_tree, decode._rows_of_one_block,
         Timings.verify_ends, Timings.verify_batch) = saved


@contextmanager
def previous_form_29(on: bool):
    """The twenty-ninth round's five cuts undone while ``on`` (module attributes the
    decode reads at call time)."""
    import rheoplan.decode as decode
    import rheoplan.distributions as dist
    import rheoplan.models._hf_common as hf_common
    import rheoplan.models.row_cache as row_cache
    from rheoplan.kernels import parallel
    from rheoplan.kernels.cache_moves import reference
    from rheoplan.kernels.verify.cpu import NodeDrawer
    from rheoplan.models.eagle3.draft import Eagle3Draft

    def per_pair(self, hids, feat_at):
        for i in feat_at:
            hids[i] = self.head.fuse(hids[i])
        return torch.stack(hids)

    split_draw = NodeDrawer.__call__

    def one_thread_draw(self, *args):
        threads = parallel.threads
        parallel.threads = lambda: 1  # the draw's count of ranges: one, the serial path
        try:
            return split_draw(self, *args)
        finally:
            parallel.threads = threads

    saved = (row_cache.move_columns, hf_common.move_columns, dist._unprocessed, Eagle3Draft._fused_hidden,
             decode._greedy_rows, NodeDrawer.__call__)
    if on:
        row_cache.move_columns = hf_common.move_columns = reference.move_columns
        dist._unprocessed = lambda sampling, processors: False
        Eagle3Draft._fused_hidden = per_pair
        decode._greedy_rows = lambda *args: None
        NodeDrawer.__call__ = one_thread_draw
    try:
        yield
    finally:
        (row_cache.move_columns, hf_common.move_columns, dist._unprocessed, Eagle3Draft._fused_hidden,
         decode._greedy_rows, NodeDrawer.__call__) = saved


def decodes(args) -> None:
    from rheoplan.bench.batch import held_out_groups
    from rheoplan.loading import load_default

    model, tok, draft = load_default(dtype="bfloat16", draft_dtype="bfloat16")
    B = 1 if args.what == "decode" else args.rows
    groups = args.prompts if args.what == "decode" else args.batches
    run = held_out_groups(model, tok, draft, B, groups, args.tokens, args.temperature)

    run(0)  # warm-up: first-call work of the process
    phases = ("t_draft", "t_plan", "t_verify_forward", "t_walk", "t_commit", "t_step")
    wall, tokens, steps = {True: 0.0, False: 0.0}, {True: 0, False: 0}, {True: 0, False: 0}
    per = {True: dict.fromkeys(phases, 0.0), False: dict.fromkeys(phases, 0.0)}
    same = 0
    for k in range(groups):
        got = {}
        for old in ((False, True) if k % 2 == 0 else (True, False)):
            with previous_form(old, args.round):
                t = time.perf_counter()
                res = run(k)
                wall[old] += time.perf_counter() - t
            got[old] = [r.tokens for r in res]
            tokens[old] += sum(len(r.tokens) for r in res)
            batch_steps = {(st.t_step, st.t_verify_forward): st for r in res for st in r.steps}
            steps[old] += len(batch_steps)  # a batch's step is one step, whatever its rows
            for st in batch_steps.values():
                for f in phases:
                    per[old][f] += getattr(st, f)
        same += got[True] == got[False]
    for old, name in ((False, "this round"), (True, "previous form")):
        ms = " ".join(f"{f[2:]} {1e3 * per[old][f] / steps[old]:.2f}" for f in phases)
        print(f"{name:>14}: {tokens[old] / wall[old]:.1f} tokens/s; ms a step: {ms} ({steps[old]} steps)")
    print(f"this round / previous form: {wall[True] / wall[False]:.3f}x; the same tokens in {same} of {groups} "
          f"{'prompts' if B == 1 else 'batches'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--what", choices=("moves", "decode", "batch"), default="moves")
    ap.add_argument("--rows", type=int, default=4, help="rows of the caches (moves) or prompts per batch (batch)")
    ap.add_argument("--calls", type=int, default=200, help="calls per side (moves)")
    ap.add_argument("--prompts", type=int, default=12, help="held-out prompts (decode)")
    ap.add_argument("--batches", type=int, default=6, help="batches (batch)")
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per prompt (decode, batch)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--round", type=int, choices=(29, 30), default=30, help="whose cuts to switch (decode, batch)")
    args = ap.parse_args()
    for name in ("rows", "prompts", "batches", "tokens", "threads"):
        if getattr(args, name) < 1:
            ap.error(f"--{name}={getattr(args, name)}: allowed >= 1")
    if args.calls < 6:
        ap.error(f"--calls={args.calls}: allowed >= 6 (the first 5 are warm-up)")
    if args.temperature < 0:
        ap.error(f"--temperature={args.temperature}: allowed >= 0")
    torch.set_num_threads(args.threads)
    if args.what == "moves":
        moves(args)
    else:
        decodes(args)


if __name__ == "__main__":
    main()
