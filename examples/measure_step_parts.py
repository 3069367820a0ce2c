"""Time the two step parts the lean-step work changed, interleaved in one process (medians):

* the walk's output projections on SmolLM2 (576 x 49152 lm_head): one row; the lazy walk's
  likely path (5 rows) in one batch plus one node off it; every row of a 9-node tree at once
  (what ``HFTarget.projection='auto'`` picks when it measures that cheaper);
* one drafted depth's draft law and top-128 for 3 frontier rows of the shipped EAGLE-3 head:
  over the dense 49152-column logits (scattered, ``-inf`` outside the head's vocabulary)
  versus over the head's own 8192 columns (``SubsetLogits``, what the decode loop now passes);
* the walk's draw at a node whose proposal is rejected (the residual over 49152 tokens is
  drawn): the reference rule (``Streams`` numbers, ``_coupling_draw``, the filtered
  Gumbel-max in torch) versus ``backend='numba'``'s kernel, which makes the same numbers
  itself (``kernels.verify.cpu.walk_node_draw``); both must emit the same token.

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

from rheoplan.config import VERIFIER_CODES, SamplingConfig
from rheoplan.distributions import SubsetLogits, draft_probs, target_probs
from rheoplan.kernels.slot_expansion.cpu import rank_support_rows
from rheoplan.kernels.verify.cpu import walk_node_draw
from rheoplan.rng import Purpose, Streams, philox_counter
from rheoplan.verify import _coupling_draw, gumbel_max_uniform
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

    # a node of an 'ot' tree (m=1, K=3) whose sampled token is one the target finds unlikely
    p = target_probs(lm(hid[:1]).detach().float()[0], s)
    V = p.shape[0]
    sup = p.argsort(descending=True)[:128]
    sup_q = torch.softmax(torch.randn(128, generator=torch.Generator().manual_seed(0)), 0).sort(descending=True).values
    y, st, node = int(sup[100]), Streams(0), 5
    law = np.zeros(V)
    ctr = lambda purpose: np.array(philox_counter(0, 0, node, int(purpose)), dtype=np.uint64)  # noqa: E731

    def draw_reference():
        u = float(st.uniform(0, 0, node, Purpose.VERIFY_ACCEPT, 1)[0])
        residual = lambda r: int(gumbel_max_uniform(  # noqa: E731
            r[None], st.uniform(0, 0, node, Purpose.VERIFY_RESIDUAL, V)[None])[0])
        return _coupling_draw(p, sup, sup_q, 128, 1, 3, y, "ot", u, residual)

    def draw_kernel():
        return int(walk_node_draw(p.numpy(), sup.numpy(), sup_q.numpy(), 128, 1, 3, y, VERIFIER_CODES["ot"],
                                  np.uint64(0), ctr(Purpose.VERIFY_ACCEPT), ctr(Purpose.VERIFY_RESIDUAL), law))

    if draw_reference() != draw_kernel():
        raise SystemExit("the walk's kernel draw differs from the reference rule")
    parts = {
        "projection, 1 row": lambda: lm(hid[:1]).float(),
        "projection, lazy walk (5 rows + 1 row)": lambda: (lm(hid[:5]).float(), lm(hid[5:6]).float()),
        "projection, every row (9 rows)": lambda: lm(hid).float(),
        "draft law + top-128, dense 49152 columns": lambda: top128(draft_probs(SubsetLogits(logits, ids).dense(vocab), s)),
        "draft law + top-128, the head's 8192 columns": lambda: ids.numpy()[top128(draft_probs(logits, s))],
        "walk draw at a rejected node, reference rule": draw_reference,
        "walk draw at a rejected node, numba kernel": draw_kernel,
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
