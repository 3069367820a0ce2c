"""The twenty-ninth round's five step cuts against their previous form, in one process.

The round changed five things in a decode's steps (docs/results.md, "Twenty-ninth round"):

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

This script switches the five back to their previous form and forward again between runs:

* ``--what moves``: the commit's moves alone on SmolLM2-shaped caches (30 layers of keys
  and values ``[rows, 3, width, 64]``, bfloat16, prefix views of larger buffers), kernel
  and reference alternating call by call; prints medians and whether they agree bit for bit.
* ``--what decode``: one-row decodes of held-out prompts as ``rheoplan generate`` runs them,
  alternating prompt by prompt; ``--what batch``: static batches of ``--rows`` prompts,
  alternating batch by batch. Both print tokens/s, ms per step by phase and how many
  prompts / batches got the same tokens (the draft's one product rounds differently from
  its per-pair products, so a batch's trees, and at T > 0 its tokens, may differ: both
  exact).

docs/results.md, "Twenty-ninth round", quotes it:

    python examples/measure_step_cuts.py --what moves [--rows 4] [--calls 200]
    python examples/measure_step_cuts.py --what decode [--prompts 12] [--temperature 1]
    python examples/measure_step_cuts.py --what batch [--rows 4] [--batches 6] [--temperature 1]
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


@contextmanager
def previous_form(on: bool):
    """The five cuts undone while ``on`` (module attributes the decode reads at call time)."""
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
            with previous_form(old):
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
