"""How long the cost model's first measurement takes on this machine, for one row and for
batches.

Loads SmolLM2 and the shipped head once (bfloat16), then builds the cost model of
``rheoplan generate``'s default trees with an empty cache each time, alternating
``load_cost_model(..., batched=True)`` (what a decode of several prompts needs: one row's
prices and the batched forwards and steps at 4 and 16 rows) and ``batched=False`` (one
row's prices: what ``rheoplan generate`` with one prompt measures). Each measurement goes
to a temporary cache directory, removed afterwards: the user's cache is neither read nor
written. docs/cli.md ("The cost model") quotes this script:

    python examples/measure_first_cost_model.py [--rounds 2] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import torch

from rheoplan.bench.decode import methods_for
from rheoplan.loading import FIXED_TREE, load_cost_model, load_default


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2, help="measurements of each kind (default 2)")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    if a.rounds < 1:
        raise SystemExit(f"--rounds={a.rounds}: allowed >= 1")
    if a.threads < 1:
        raise SystemExit(f"--threads={a.threads}: allowed >= 1")
    torch.set_num_threads(a.threads)
    model, tok, draft = load_default(method="rheo", draft="auto", dtype="bfloat16", draft_dtype="bfloat16")
    tree = methods_for(**FIXED_TREE)["default"].tree
    before = os.environ.get("RHEOPLAN_CACHE_DIR")
    seconds: dict[bool, list[float]] = {True: [], False: []}
    try:
        for r in range(a.rounds):
            for batched in ((True, False) if r % 2 == 0 else (False, True)):
                tmp = tempfile.mkdtemp(prefix="rheoplan-cost-")
                os.environ["RHEOPLAN_CACHE_DIR"] = tmp
                try:
                    t0 = time.perf_counter()
                    load_cost_model(model, tok, draft, tree, draft_id="auto", batched=batched)
                    seconds[batched].append(time.perf_counter() - t0)
                finally:
                    shutil.rmtree(tmp, ignore_errors=True)
                print(f"round {r + 1}: batched={batched}: {seconds[batched][-1]:.1f} s", flush=True)
    finally:
        if before is None:
            os.environ.pop("RHEOPLAN_CACHE_DIR", None)
        else:
            os.environ["RHEOPLAN_CACHE_DIR"] = before
    for batched, label in ((False, "one row (batched=False)"), (True, "batches too (batched=True)")):
        print(f"{label}: {', '.join(f'{s:.1f}' for s in seconds[batched])} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
