"""The planner's own cost, free of the models: record the plans of real decodes, replay them.

Decodes held-out prompts with the defaults of ``rheoplan generate`` (bfloat16, the shipped
head, the cost model) and records every plan of the decode loop (``plan_tree``, or the
fused cost pipeline ``kernels.plan.cpu_pipeline.plan_cost_tree`` that a decode runs when
nothing watches its passes): its arguments and the draft head's answers. Then it plans every recorded step again with a draft that hands back the
recorded answers, checks that each replayed tree is the recorded one (same linear tokens),
and times the replay: the passes, the cost model's gates and the tree's setup, with no
draft call and no target forward in between. A change to the planner measured this way
needs no quiet machine spell: the same steps are planned again and again in one process.

Run it once per version of the code (``git stash`` in between) and compare the medians;
``--passes`` prints the time of each pass per step, ``--profile N`` the N functions with the
most time of their own (cProfile). ``--passes`` replays the fused plans through their pass
list (``cost_pipeline`` over the numba passes: the same trees), whose passes it can time. The replay is hot (the caches stay warm from one plan to
the next): inside a decode the same plan takes about twice as long (``examples/
function_timers.py``, ``_plan`` minus ``draft_answer``).

    python examples/plan_replay.py [--prompts 6] [--tokens 64] [--temperature 1.0] [--reps 15]
        [--passes] [--profile 30]

docs/results.md, "Twenty-third round", quotes it.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch


@contextlib.contextmanager
def recording():
    """Within the block, every plan of the decode loop (``plan_tree`` or the fused
    ``plan_cost_tree``, whose keyword arguments hold ``plan``) is recorded: yields the list it
    fills with ``(roots, kwargs, draft answers, linear tokens)``."""
    import rheoplan.decode as dec

    records = []
    real = dec.plan_tree, dec.plan_cost_tree

    def recorder(planner):
        def recorded(draft_fn, roots, **kw):
            answers = []

            def draft(tree, nodes):
                out = draft_fn(tree, nodes)
                answers.append(out)
                return out

            t = planner(draft, roots, **kw)
            kw.pop("on_decision", None)  # the decode's statistics: a replay leaves them alone
            records.append((roots, kw, answers, t.linear.token.clone()))
            return t
        return recorded

    dec.plan_tree, dec.plan_cost_tree = recorder(real[0]), recorder(real[1])
    try:
        yield records
    finally:
        dec.plan_tree, dec.plan_cost_tree = real


def plan_again(draft, roots, kw: dict, instruments=(), via_passes: bool = False):
    """The recorded plan ``kw`` of ``roots`` again, with ``draft``: by the planner that made
    it, or, for a fused plan with ``instruments`` or ``via_passes``, by its pass list (the
    same tree)."""
    from rheoplan.kernels.plan.cpu_pass import decide, frontiers
    from rheoplan.kernels.plan.cpu_pipeline import plan_cost_tree
    from rheoplan.pipeline import lower
    from rheoplan.plan import plan_tree
    from rheoplan.planner.default import DEFAULT_PIPELINE, cost_pipeline

    if "plan" not in kw:
        return plan_tree(draft, roots, **{**kw, "instruments": list(kw.get("instruments", ())) + list(instruments)})
    if not instruments and not via_passes:
        return plan_cost_tree(draft, roots, **kw)
    rest = {k: v for k, v in kw.items() if k not in ("plan", "arena")}  # (the fused plan's own)
    passes = cost_pipeline(kw["plan"], lower(DEFAULT_PIPELINE, "numba"), decide=decide, frontiers=frontiers)
    return plan_tree(draft, roots, passes=passes, backend="numba", instruments=list(instruments), **rest)


def record(args):
    """The records of decodes of ``args.prompts`` held-out prompts on SmolLM2 with the
    shipped head, as ``rheoplan generate`` decodes."""
    from rheoplan.bench.batch import DEFAULT_TREE
    from rheoplan.bench.decode import load_prompts
    from rheoplan.config import SamplingConfig
    from rheoplan.decode import plan_and_decode
    from rheoplan.loading import encode_prompt, load_cost_model, load_default

    model, tok, draft = load_default(method="rheo", draft="auto", dtype="bfloat16")
    cost = load_cost_model(model, tok, draft, DEFAULT_TREE, draft_id="auto")
    prompts = [encode_prompt(tok, p, chat=True) for _, p in load_prompts(args.prompts)]
    sampling = SamplingConfig(temperature=args.temperature)
    with recording() as records:
        for i, p in enumerate(prompts):
            plan_and_decode(model, draft, p, max_new_tokens=args.tokens, sampling=sampling, tree=DEFAULT_TREE,
                            cost_model=cost, seed=i)
    return records


def replay(records, instruments=()) -> float:
    """Plan every recorded step again; seconds in all."""
    t0 = time.perf_counter()
    for roots, kw, answers, _ in records:
        it = iter(answers)
        plan_again(lambda tree, nodes: next(it), roots, kw, instruments)
    return time.perf_counter() - t0


def check(records) -> None:
    """Every replayed tree is the recorded one (else the replay measures another plan),
    fused plans through their pass list too."""
    for i, (roots, kw, answers, lin) in enumerate(records):
        for via_passes in ((False, True) if "plan" in kw else (False,)):
            it = iter(answers)
            t = plan_again(lambda tree, nodes: next(it), roots, kw, via_passes=via_passes)
            if not torch.equal(t.linear.token, lin):
                raise ValueError(f"step {i}: the replayed tree differs from the recorded one")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=15, help="replays of the whole record (default 15)")
    ap.add_argument("--passes", action="store_true", help="also print each pass's time per step")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="also print the N functions with the most time of their own (cProfile)")
    args = ap.parse_args()
    for name in ("prompts", "tokens", "threads", "reps"):
        if getattr(args, name) < 1:
            ap.error(f"--{name}={getattr(args, name)}: allowed >= 1")
    if args.temperature < 0:
        ap.error(f"--temperature={args.temperature}: allowed >= 0")
    torch.set_num_threads(args.threads)
    records = record(args)
    check(records)
    n = len(records)
    times = [replay(records) for _ in range(args.reps)]
    print(f"{n} steps recorded; replayed {args.reps} times: plan without the draft "
          f"{1e6 * statistics.median(times) / n:.1f} us per step (median), {1e6 * min(times) / n:.1f} (min)")
    if args.passes:
        from rheoplan.pipeline import PassTiming

        timing = PassTiming()
        replay(records, [timing])
        for name, total in sorted(timing.totals.items(), key=lambda kv: -kv[1]):
            print(f"  {name:<10s} {1e6 * total / n:8.1f} us per step ({timing.counts[name] / n:.2f} runs per step)")
    if args.profile:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        replay(records)
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(args.profile)


if __name__ == "__main__":
    main()
