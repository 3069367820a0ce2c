"""Time the two step parts the lean-step work changed, interleaved in one process (medians):

* the walk's output projections on SmolLM2 (576 x 49152 lm_head): one row; the lazy walk's
  likely path (5 rows) in one batch plus one node off it; every row of a 9-node tree at once
  (what ``HFTarget.projection='auto'`` picks when it measures that cheaper);
* one drafted depth's draft law and top-128 for 3 frontier rows of the shipped EAGLE-3 head:
  over the dense 49152-column logits (scattered, ``-inf`` outside the head's vocabulary)
  versus over the head's own 8192 columns (``SubsetLogits``, what the decode loop now passes).

Interleaved (one call of each per round), so a machine that slows down slows all alike;
absolute times still need a quiet machine.

Usage:
    python examples/measure_step_parts.py [--dtype bfloat16] [--threads 2] [--reps 30]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from rheoplan.config import SamplingConfig
from rheoplan.distributions import SubsetLogits, draft_probs
from rheoplan.kernels.slot_expansion.cpu import rank_support_rows
from rheoplan.models.eagle3 import read_eagle3
from rheoplan.models.smollm import load_smollm2

HEAD = Path(__file__).resolve().parents[1] / "rheoplan" / "assets" / "smollm2-eagle3"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, _ = load_smollm2(getattr(torch, args.dtype))
    lm = model.lm_head
    head = read_eagle3(HEAD)
    ids = head.target_ids()
    vocab = model.config.vocab_size
    hid = torch.randn(9, model.config.hidden_size, dtype=model.dtype)
    out3 = torch.randn(3, head.config.hidden_size)
    logits = head.draft_logits(out3).detach().float()  # the head's projection is common to both
    s = SamplingConfig()

    def top128(q):
        tok, val = np.empty((q.shape[0], 128), np.int64), np.empty((q.shape[0], 128), np.float32)
        rank_support_rows(q.numpy(), 128, tok, val)
        return tok

    parts = {
        "projection, 1 row": lambda: lm(hid[:1]).float(),
        "projection, lazy walk (5 rows + 1 row)": lambda: (lm(hid[:5]).float(), lm(hid[5:6]).float()),
        "projection, every row (9 rows)": lambda: lm(hid).float(),
        "draft law + top-128, dense 49152 columns": lambda: top128(draft_probs(SubsetLogits(logits, ids).dense(vocab), s)),
        "draft law + top-128, the head's 8192 columns": lambda: ids.numpy()[top128(draft_probs(logits, s))],
    }
    ms = {k: [] for k in parts}
    with torch.no_grad():
        for f in parts.values():
            f()
        for _ in range(args.reps):
            for k, f in parts.items():
                t0 = time.perf_counter()
                f()
                ms[k].append(1e3 * (time.perf_counter() - t0))
    print(f"{args.dtype}, {args.threads} threads, {args.reps} interleaved rounds: median ms")
    for k, v in ms.items():
        print(f"  {k:46s} {statistics.median(v):8.2f}")


if __name__ == "__main__":
    main()
