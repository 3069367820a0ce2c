"""SmolLM2's load from its GGUF file against its converted copy (``rheoplan.models.gguf_copy``).

transformers parses the GGUF anew on every load; the first load keeps a float32 copy that
later loads read. This script times both, alternating in one process (the order rotating
per round), after one load that makes the copy if it is missing, and checks that the two
give the same weights bit for bit. Prints seconds per load, each round and the medians.

    python examples/measure_model_load.py --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="loads of each kind (>= 1; default 3)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (>= 1; default 2)")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds={args.rounds} is out of range: allowed >= 1")
    if args.threads < 1:
        ap.error(f"--threads={args.threads} is out of range: allowed >= 1")
    torch.set_num_threads(args.threads)
    from rheoplan.models.smollm import load_smollm2

    load_smollm2()  # makes the copy if it is missing (and says so)
    kinds = {"gguf": lambda: load_smollm2(use_copy=False), "copy": lambda: load_smollm2()}
    seconds = {k: [] for k in kinds}
    loaded = {}
    names = list(kinds)
    for r in range(args.rounds):
        for k in names[r % 2:] + names[:r % 2]:
            t0 = time.perf_counter()
            loaded[k], _ = kinds[k]()
            seconds[k].append(time.perf_counter() - t0)
        print(f"round {r}: " + ", ".join(f"{k} {seconds[k][-1]:.2f} s" for k in names), flush=True)
    a, b = loaded["gguf"].state_dict(), loaded["copy"].state_dict()
    same = a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    print("median: " + ", ".join(f"{k} {statistics.median(seconds[k]):.2f} s" for k in names)
          + f"; the same weights bit for bit: {same}")


if __name__ == "__main__":
    main()
