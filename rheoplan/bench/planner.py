"""Benchmark the reference planner passes at the paper's tree size.

N = 60 kept nodes, depth 8, frontier 10, slots 10, rheostat 1, support 128, over a
32000-token draft vocabulary. The draft is a lookup into a table of random logits, so
model time is negligible; its time is reported separately from the passes.

    rheoplan bench planner [--steps 20] [--batch 1]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from rheoplan.config import SamplingConfig, TreeConfig
from rheoplan.kernels.pipeline import kernel_pipeline
from rheoplan.plan import plan_tree
from rheoplan.pipeline import Instrument, PassTiming


class StepTimes(Instrument):
    """Per-step, per-pass wall times (PassTiming only keeps totals)."""

    def __init__(self):
        self.steps: list[dict[str, float]] = []
        self._t0 = 0.0

    def run_start(self, tree, ctx):
        self.steps.append({})

    def before_pass(self, index, name, tree, ctx):
        self._t0 = time.perf_counter()

    def after_pass(self, index, name, tree, ctx):
        key = name.split("@")[0]
        self.steps[-1][key] = self.steps[-1].get(key, 0.0) + time.perf_counter() - self._t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="rheoplan bench planner", description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    ap.add_argument("--pipeline", choices=["reference", "kernels", "both"], default="both",
                    help="reference passes, the numba kernel pipeline, or both side by side (default)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    names = ["reference", "kernels"] if args.pipeline == "both" else [args.pipeline]
    for name in names:
        print(f"=== {name} pipeline ===")
        run(args, name)
    return 0


def run(args, pipeline_name: str) -> None:
    passes = kernel_pipeline("cpu") if pipeline_name == "kernels" else None

    cfg = TreeConfig(depth=8, frontier=10, slots=10, budget=60, rheostat=1, support=128)
    sampling = SamplingConfig(temperature=1.0)
    table = torch.randn(256, args.vocab, generator=torch.Generator().manual_seed(0)) * 3
    draft_time = [0.0]

    def draft(tree, nodes):
        t0 = time.perf_counter()
        out = table[(nodes.clamp(min=0) * 31 + tree.token[:, :1]) % table.shape[0]]
        draft_time[0] += time.perf_counter() - t0
        return out

    roots = list(range(args.batch))
    plan_tree(draft, roots, tree=cfg, sampling=sampling, passes=passes)  # warm-up (numba compile)
    per_step = StepTimes()
    totals, drafts = [], []
    for step in range(args.steps):
        draft_time[0] = 0.0
        t0 = time.perf_counter()
        tree = plan_tree(draft, roots, tree=cfg, sampling=sampling, seed=1, step=step,
                         instruments=[per_step, PassTiming()], passes=passes)
        totals.append(time.perf_counter() - t0)
        drafts.append(draft_time[0])
    ms = lambda xs: f"mean {1e3 * statistics.mean(xs):8.2f} ms   median {1e3 * statistics.median(xs):8.2f} ms"  # noqa: E731
    print(f"config: {cfg}\nvocab {args.vocab}, batch {args.batch}, {args.steps} steps, "
          f"torch threads {torch.get_num_threads()}, "
          f"{int(tree.n_nodes[0])} nodes created, {int(tree.linear.n[0])} kept (root included)\n")
    print(f"{'plan+linearize / step':<28s}{ms(totals)}")
    print(f"{'  of which draft callback':<28s}{ms(drafts)}")
    for name in per_step.steps[0]:
        xs = [s[name] for s in per_step.steps[1:] or per_step.steps]
        print(f"{'  pass ' + name:<28s}{ms(xs)}")
    print("\n(expand includes the draft callback; per-pass times summed over the depth loop)\n")


if __name__ == "__main__":
    raise SystemExit(main())
