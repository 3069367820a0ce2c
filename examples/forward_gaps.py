"""What runs before a timed verify forward changes what a forward of many tokens costs.

Times SmolLM2's verify forward (bfloat16, the decoder alone, as the cost model's curve
does) of a chain of 1, 4, 9 and 17 tokens, round-robin over the sizes and over what runs
untimed before each forward: nothing (back to back), a few ms of busy Python, a sleep,
an output projection of one row (what ``rheoplan.probe.chain_verify_ms`` runs now), the
projection and then busy Python. Then decodes held-out prompts with fixed trees of
budget 3, 8 and 16 and plainly (the budgets rotating per prompt) and takes the median
forward per tree size, then runs the probe rounds again. Prints each forward over the
one-token forward of the same kind. docs/results.md, "Forwards timed as a decode runs
them", quotes this script's numbers:

    python examples/forward_gaps.py [--rounds 12] [--ctx 120] [--prompts 8] [--tokens 32] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial

import torch


def busy(ms: float) -> None:
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        pass


def probe_rounds(model, ctx: int, sizes, rounds: int, variants) -> dict:
    """{variant: [median ms per size]}: every (variant, size) once per round."""
    from rheoplan.models import as_target
    from rheoplan.probe import chain_linear

    vocab = int(model.config.vocab_size)
    prompt = [(7 * i + 3) % vocab for i in range(ctx + 1)]
    tgt = as_target(model)
    samples = {(v, n): [] for v in variants for n in sizes}
    try:
        with torch.no_grad():
            tgt.start(prompt)
            forwards = {n: partial(tgt.forward_tree, chain_linear(prompt[-1], ctx, n)) for n in sizes}
            for f in forwards.values():
                f()
            for _ in range(rounds):
                for v, before in variants.items():
                    for n in sizes:
                        before()
                        t0 = time.perf_counter()
                        forwards[n]()
                        samples[v, n].append(1e3 * (time.perf_counter() - t0))
    finally:
        tgt.close()
    return {v: [statistics.median(samples[v, n]) for n in sizes] for v in variants}


def decode_forwards(model, tok, draft, prompts: int, tokens: int, budgets) -> dict:
    """{tree tokens: [forward ms]} over decodes of held-out prompts, the budgets (0: no
    draft) rotating per prompt."""
    from rheoplan.bench.batch import DEFAULT_TREE
    from rheoplan.bench.decode import load_prompts
    from rheoplan.config import SamplingConfig
    from rheoplan.decode import plan_and_decode
    from rheoplan.loading import encode_prompt

    ids = [encode_prompt(tok, p, chat=True) for _, p in load_prompts(prompts)]
    sampling = SamplingConfig(temperature=1.0)
    out: dict[int, list[float]] = {}
    for i, p in enumerate(ids):
        k = i % len(budgets)
        for b in budgets[k:] + budgets[:k]:
            r = (plan_and_decode(model, None, p, max_new_tokens=tokens, sampling=sampling, seed=i) if b == 0 else
                 plan_and_decode(model, draft, p, max_new_tokens=tokens, sampling=sampling,
                                 tree=DEFAULT_TREE.with_(budget=b), seed=i))
            for st in r.steps:
                if st.t_verify_forward > 0:
                    out.setdefault(st.tree_size + 1, []).append(1e3 * st.t_verify_forward)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--ctx", type=int, default=120, help="cached tokens of the probe's forwards")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    for name in ("rounds", "ctx", "prompts", "tokens", "threads"):
        if getattr(a, name) < 1:
            ap.error(f"--{name}={getattr(a, name)}: allowed >= 1")
    from rheoplan.loading import load_default
    from rheoplan.probe import output_projection_gap

    torch.set_num_threads(a.threads)
    model, tok, draft = load_default(method="rheo", draft="auto", dtype="bfloat16")
    project = output_projection_gap(model)  # what the cost model's probe runs before each forward
    variants = {"nothing (back to back)": lambda: None, "6 ms busy Python": lambda: busy(6),
                "6 ms sleep": lambda: time.sleep(0.006), "output projection": project,
                "projection + 6 ms busy": lambda: (project(), busy(6))}
    sizes = [1, 4, 9, 17]
    first = probe_rounds(model, a.ctx, sizes, a.rounds, variants)
    real = decode_forwards(model, tok, draft, a.prompts, a.tokens, [0, 3, 8, 16])
    second = probe_rounds(model, a.ctx, sizes, a.rounds, variants)
    print(f"forward ms over the one-token forward of the same kind ({a.ctx} cached tokens; first / second round)")
    print("| before each timed forward | " + " | ".join(f"{n} tokens" for n in sizes[1:]) + " |")
    print("|---|" + "---|" * (len(sizes) - 1))
    for v in variants:
        cells = [f"{first[v][j] / first[v][0]:.2f} / {second[v][j] / second[v][0]:.2f}" for j in range(1, len(sizes))]
        print(f"| {v} | " + " | ".join(cells) + " |")
    base = statistics.median(real.get(1, [float("nan")]))
    cells = [f"{statistics.median(real[n]) / base:.2f} ({len(real[n])})" if n in real else "–" for n in sizes[1:]]
    print("| real decodes (forwards) | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
