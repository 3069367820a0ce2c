"""A lone row by eights: what the few-row kernel's one-row path saves on this machine.

Before, the kernel multiplied one input row the way it multiplies two: paired with
itself, every multiply done twice (``kernels.linear.cpu._pair_times_four``). Now a lone row
runs against eight weight rows at a time (``_row_times_eight``), each multiply once. A
two-row product of the row twice costs what the old one-row path did (the same loop, the
same reads), so this script compares

1. per matrix of SmolLM2-135M's shapes (random weights, hot in the caches): one row,
   the row twice (the old path's work) and torch's one-row product, in us (median of
   interleaved calls), and checks that the lone row's result is the bits of either row
   of the pair;
2. every matrix of the loaded model in turn, as a forward reads them (weights from
   memory): the same three, in ms per pass (median over interleaved passes).

Whether the kernel serves one-row products of a model is still the loader's measurement
(``rheoplan.models.packed_linear.few_rows_decision``); this script times the kernel
either way. docs/results.md, "A lone row by eights", quotes it:

    python examples/measure_lone_row.py [--dtype bfloat16] [--passes 40] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (8192, 576), (49152, 576)]


def interleaved(fns: dict, reps: int) -> dict:
    """Median seconds per call of each of ``fns``, called in turn ``reps`` times."""
    for f in fns.values():
        f()
    times = {k: [] for k in fns}
    for _ in range(reps):
        for k, f in fns.items():
            t0 = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    ap.add_argument("--passes", type=int, default=40, help="interleaved passes over the model (>= 1)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (>= 1)")
    args = ap.parse_args(argv)
    if args.passes < 1 or args.threads < 1:
        raise SystemExit(f"--passes={args.passes} and --threads={args.threads} must be >= 1")
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)

    from rheoplan.kernels.linear import cpu
    from rheoplan.models.smollm import load_smollm2

    g = torch.Generator().manual_seed(0)
    print(f"1. one product, {args.dtype}, hot in the caches: us for one row (now) / the row twice "
          f"(the old one-row path's work) / torch's one row")
    same = True
    for out_f, in_f in SHAPES:
        w = torch.randn(out_f, in_f, generator=g).to(dtype)
        wn = cpu.weight_array(w)
        x = torch.randn(1, in_f, generator=g).to(dtype)
        xx = x.repeat(2, 1)
        one, two = cpu.rows_times(x, wn), cpu.rows_times(xx, wn)
        same &= torch.equal(one.float(), two[:1].float()) and torch.equal(one.float(), two[1:].float())
        t = interleaved({"one": lambda: cpu.rows_times(x, wn), "twice": lambda: cpu.rows_times(xx, wn),
                         "torch": lambda: torch.nn.functional.linear(x, w)}, 300 if out_f < 40000 else 40)
        print(f"   {out_f:>5} x {in_f:<5} {1e6 * t['one']:8.1f} {1e6 * t['twice']:8.1f} {1e6 * t['torch']:8.1f}")
    print(f"   the lone row's result is the bits of the pair's rows: {same}")

    model, _ = load_smollm2(dtype=dtype)
    lins = [m for m in model.modules() if type(m) is torch.nn.Linear]
    ws = [cpu.weight_array(m.weight) for m in lins]
    xs = [torch.randn(1, m.in_features, generator=g).to(dtype) for m in lins]
    xxs = [x.repeat(2, 1) for x in xs]

    def run(inputs):
        def f():
            for x, w in zip(inputs, ws):
                cpu.rows_times(x, w)
        return f

    def torch_run():
        for x, m in zip(xs, lins):
            torch.nn.functional.linear(x, m.weight)

    t = interleaved({"one": run(xs), "twice": run(xxs), "torch": torch_run}, args.passes)
    print(f"2. the model's {len(lins)} matrices in turn, weights from memory, ms per pass: one row "
          f"{1e3 * t['one']:.2f}, the row twice {1e3 * t['twice']:.2f}, torch's one row {1e3 * t['torch']:.2f}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
