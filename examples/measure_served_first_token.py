"""The first token served by the prompt's forward, against verifying the last prompt token.

``plan_and_decode`` draws the first new token from the target's prefill (the output at the
last prompt token, as ``generate`` does; ``TargetModel.start_and_root``) instead of
prefilling all but the last prompt token and verifying that token as the first tree's
root (one forward more). This script measures what that saves on SmolLM2 with the shipped
head and the cost model (what ``rheoplan generate`` runs): transformers ``generate``,
rheoplan with the served first token (``served``) and with it turned off (``unserved``:
the target adapter's ``start_and_root`` methods patched to return None), interleaved
batch by batch in one process (the order rotates), at each batch size. Prints tokens/s
(prefill included) and each rheoplan column against ``generate``.

    python examples/measure_served_first_token.py --batch-sizes 1 4 --prompts 16 --tokens 64
"""

from __future__ import annotations

import argparse
from contextlib import contextmanager

import torch

from rheoplan.bench.batch import DEFAULT_TREE, run_batched, run_generate, run_rowwise
from rheoplan.bench.decode import load_prompts
from rheoplan.loading import encode_prompt, load_cost_model, load_default
from rheoplan.models.hf_target import HFTarget

#: the adapter methods that serve the first token (None: the loop verifies the last prompt token)
SERVING = ("start_and_root", "start_rows_and_roots", "add_rows_and_roots")


@contextmanager
def unserved():
    """HFTarget without the served first token (the loop falls back to ``start``)."""
    saved = {n: HFTarget.__dict__[n] for n in SERVING}
    try:
        for n in SERVING:
            setattr(HFTarget, n, lambda self, *a, **k: None)
        yield
    finally:
        for n, f in saved.items():
            setattr(HFTarget, n, f)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4])
    p.add_argument("--prompts", type=int, default=16, help="held-out prompts (at most 40)")
    p.add_argument("--tokens", type=int, default=64, help="new tokens per row")
    p.add_argument("--temperatures", type=float, nargs="+", default=[1.0, 0.0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=None)
    a = p.parse_args()
    if not 1 <= a.prompts <= 40:
        p.error(f"--prompts={a.prompts}: allowed 1..40")
    if a.tokens < 1:
        p.error(f"--tokens={a.tokens}: allowed >= 1")
    bad = [b for b in a.batch_sizes if not 1 <= b <= a.prompts]
    if bad:
        p.error(f"--batch-sizes {bad}: allowed 1..--prompts ({a.prompts})")
    if a.threads:
        torch.set_num_threads(a.threads)
    model, tok, draft = load_default(method="rheo", draft="auto", dtype=a.dtype)
    pad_id = tok.eos_token_id if tok.eos_token_id is not None else 0
    prompts = [encode_prompt(tok, text, chat=True) for _, text in load_prompts(a.prompts)]
    cost = load_cost_model(model, tok, draft, DEFAULT_TREE, draft_id="auto")

    def rheoplan_run(rows, t, seed):
        if len(rows) == 1:  # a single sequence: the batch-1 loop, as rheoplan generate
            return run_rowwise(model, draft, rows, t, seed, a.tokens, cost, DEFAULT_TREE)
        return run_batched(model, draft, rows, t, seed, a.tokens, cost, DEFAULT_TREE)

    def run(method, rows, t, seed):
        if method == "generate":
            return run_generate(model, pad_id, rows, t, seed, a.tokens)
        if method == "unserved":
            with unserved():
                return rheoplan_run(rows, t, seed)
        return rheoplan_run(rows, t, seed)

    methods = ["generate", "served", "unserved"]
    for m in methods:  # warm-up, untimed
        run(m, prompts[:1], 1.0, 0)
    print(f"{'T':>4} {'batch':>5} | " + " | ".join(f"{m:>9} tok/s" for m in methods) + " | served/gen | unserved/gen")
    for t in a.temperatures:
        for b in a.batch_sizes:
            tot = {m: [0, 0.0] for m in methods}
            for k in range(0, len(prompts), b):
                rows = prompts[k:k + b]
                j = (k // b) % len(methods)
                for m in methods[j:] + methods[:j]:
                    r = run(m, rows, t, a.seed * 1000 + k)
                    tot[m][0] += r["tokens"]
                    tot[m][1] += r["seconds"]
            tps = {m: n / s for m, (n, s) in tot.items()}
            print(f"{t:>4} {b:>5} | " + " | ".join(f"{tps[m]:>15.1f}" for m in methods)
                  + f" | {tps['served'] / tps['generate']:>9.3f}x | {tps['unserved'] / tps['generate']:>10.3f}x",
                  flush=True)


if __name__ == "__main__":
    main()
