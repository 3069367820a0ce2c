"""Inclusive wall time per step of the functions a decode step spends its time in.

Decodes held-out prompts with the defaults of ``rheoplan generate`` (bfloat16, the shipped
head, the cost model) and wraps each function listed in ``TARGETS`` with a timer, plus a
timer per pass (a pipeline instrument). Prints ms per step and calls per step, largest
first. Times are inclusive and nest (``_plan`` contains every pass, ``pass.expand`` the
draft calls, ``draft_answer`` the head's layers and its projection); the timers add a
few microseconds per call. docs/results.md ("Lean steps", seventh and tenth rounds)
quotes this script.

Usage:
    python examples/function_timers.py [--prompts 6] [--tokens 64] [--temperature 1.0] [--threads 2]
        [--line MODULE:QUALNAME ...]

``--line`` also prints a line profile of the named functions over the same decodes (needs
``pip install line_profiler``); docs/results.md, "Lean steps, sixteenth round", used
``--line rheoplan.walk:verify_tree rheoplan.verify:walk rheoplan.distributions:target_probs
rheoplan.models.hf_target:HFTarget.commit rheoplan.models._hf_common:commit_cache``.
"""

from __future__ import annotations

import argparse
import collections
import importlib
import time

import torch

#: (module, attribute) pairs timed where they are looked up (module globals, class methods)
TARGETS = [
    ("rheoplan.planner.cost_depth", "another_depth_pays"),
    ("rheoplan.planner.cost_prune", "decide"),
    # the fused cost pipeline a decode plans with (no passes to time: the pass timers stay
    # empty unless RHEOPLAN_DEBUG >= 1 brings the pass list back)
    ("rheoplan.decode", "plan_cost_tree"),
    ("rheoplan.kernels.plan.cpu_pipeline", "another_depth_pays"),
    ("rheoplan.kernels.plan.cpu_pipeline", "decide"),
    ("rheoplan.kernels.plan.cpu_pipeline", "expand_assign"),
    ("rheoplan.kernels.plan.cpu_pipeline", "empty_host_tree"),
    ("rheoplan.kernels.plan.cpu_pipeline", "linearize"),
    ("rheoplan.kernels.slot_expansion.cpu_pass", "draft_probs"),
    ("rheoplan.kernels.slot_expansion.cpu_pass", "rank_support_rows"),
    ("rheoplan.kernels.slot_expansion.cpu_pass", "draw_rows"),
    ("rheoplan.decode", "draft_answer"),
    ("rheoplan.decode", "verify_tree"),
    ("rheoplan.verify", "target_probs"),
    ("rheoplan.verify", "gumbel_max_uniform"),
    ("rheoplan.verify", "_coupling_terms"),
    ("rheoplan.models.hf_target", "HFTarget.forward_tree"),
    ("rheoplan.models.hf_target", "HFTarget.commit"),
    ("rheoplan.rng", "Streams.uniform"),
    ("rheoplan.decode", "_plan"),
    ("rheoplan.models.eagle3.head", "Eagle3Head.forward"),
    ("rheoplan.models.eagle3.head", "Eagle3Attention.forward"),
    ("rheoplan.models.eagle3.draft", "Eagle3Draft._project"),
    ("rheoplan.models.hf_target", "HFTreeLogits.all_logits"),
    ("rheoplan.kernels.verify.cpu", "NodeDrawer.__call__"),
]


def timed(totals, calls, label, f):
    def g(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            totals[label] += time.perf_counter() - t
            calls[label] += 1
    return g


def install(totals, calls) -> None:
    import rheoplan.pipeline as pipeline

    for mod, attr in TARGETS:
        obj = importlib.import_module(mod)
        *path, name = attr.split(".")
        for p in path:
            obj = getattr(obj, p)
        setattr(obj, name, timed(totals, calls, attr, getattr(obj, name)))

    class PassTimer(pipeline.Instrument):
        def before_pass(self, index, name, tree, ctx):
            self.t0 = time.perf_counter()

        def after_pass(self, index, name, tree, ctx):
            label = "pass." + name.split("@")[0]
            totals[label] += time.perf_counter() - self.t0
            calls[label] += 1

    before = pipeline.debug_instruments
    pipeline.debug_instruments = lambda: list(before()) + [PassTimer()]


def resolve(spec: str):
    """``module:qualname`` (``rheoplan.walk:verify_tree``, ``rheoplan.models.hf_target:HFTarget.commit``)
    -> the function."""
    module, sep, qual = spec.partition(":")
    if not sep or not qual:
        raise SystemExit(f"--line {spec!r}: allowed MODULE:QUALNAME, e.g. rheoplan.walk:verify_tree")
    obj = importlib.import_module(module)
    for part in qual.split("."):
        obj = getattr(obj, part)
    return obj


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--line", nargs="+", default=[], metavar="MODULE:QUALNAME",
                    help="also line-profile these functions (needs line_profiler)")
    args = ap.parse_args()
    lines = None
    if args.line:
        try:
            from line_profiler import LineProfiler
        except ImportError:
            raise SystemExit("--line needs line_profiler: pip install line_profiler") from None
        lines = LineProfiler()
        for spec in args.line:  # before the timers wrap them: profile the functions themselves
            lines.add_function(resolve(spec))
    from rheoplan.bench.batch import DEFAULT_TREE
    from rheoplan.bench.decode import load_prompts
    from rheoplan.config import SamplingConfig
    from rheoplan.decode import plan_and_decode
    from rheoplan.loading import encode_prompt, load_cost_model, load_default

    torch.set_num_threads(args.threads)
    totals, calls = collections.defaultdict(float), collections.Counter()
    install(totals, calls)
    model, tok, draft = load_default(method="rheo", draft="auto", dtype="bfloat16")
    cost = load_cost_model(model, tok, draft, DEFAULT_TREE, draft_id="auto")
    prompts = [encode_prompt(tok, p, chat=True) for _, p in load_prompts(args.prompts)]
    sampling = SamplingConfig(temperature=args.temperature)
    plan_and_decode(model, draft, prompts[0], max_new_tokens=8, sampling=sampling, tree=DEFAULT_TREE,
                    cost_model=cost, seed=99)  # warm-up, not counted
    totals.clear()
    calls.clear()
    steps = tokens = 0
    if lines is not None:
        lines.enable()
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        r = plan_and_decode(model, draft, p, max_new_tokens=args.tokens, sampling=sampling, tree=DEFAULT_TREE,
                            cost_model=cost, seed=i)
        steps, tokens = steps + len(r.steps), tokens + len(r.tokens)
    wall = time.perf_counter() - t0
    if lines is not None:
        lines.disable()
        lines.print_stats(output_unit=1e-3)
    print(f"{steps} steps, {tokens} tokens, {tokens / wall:.2f} tok/s, {1e3 * wall / steps:.2f} ms per step")
    for label in sorted(totals, key=lambda k: -totals[k]):
        print(f"{1e3 * totals[label] / steps:8.3f} ms/step {calls[label] / steps:6.2f} calls/step  {label}")


if __name__ == "__main__":
    main()
