"""Follow-ups to a `gpu_check.sh` run, in one short call (about 30 s on an H200).

    python3 scripts/gpu_diagnose.py            # needs CUDA; run from the repository root
    TRITON_INTERPRET=1 python scripts/gpu_diagnose.py --smoke   # parts 1-2 on the CPU

Three things the first GPU run (docs/gpu.md, "The first GPU run") left open; their
answers are in that section. Run it again on the next GPU: part 1 should now show every
row equal to the reference at ``block=16`` (the fix, no FMA contraction, was found in the
compiled code, not yet on a GPU).

1. slot expansion on tied logits: the parity case that failed (V = 40, support 16, row 1
   of exact ties), run five times: do the outputs move between runs (a race), and does q
   differ between tokens with equal logits (the lane computing it matters)?
2. Gumbel noise on CUDA: how many ulps torch's float64 ``log`` on the device puts between
   ``gumbel_rows(..., "triton")`` and ``Streams.gumbel``.
3. host time of a kernel call: the benchmark's CUDA-event times (~0.5 ms at batch 1 for
   tree attention against ~0.15 ms for SDPA) include the Python launcher when the GPU
   waits on the host; device time per call (torch.profiler) against wall time per call,
   and the launcher's own hot spots (cProfile).
"""

from __future__ import annotations

import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "kernels"))  # the parity tests' logits
#: ``--smoke``: parts 1 and 2 on the CPU under ``TRITON_INTERPRET=1`` (checks the script runs)
DEV = "cpu" if "--smoke" in sys.argv else "cuda"


def tied_slot_expansion() -> None:
    from conftest import _logit_rows
    from rheoplan.kernels.slot_expansion import reference, triton as tk
    from rheoplan.rng import Purpose, Streams

    V, S, m, K = 40, 16, 1, 4
    logits = _logit_rows(5, V, seed=V + m)
    parent = -torch.rand(5, generator=torch.Generator().manual_seed(0))
    st = Streams(5)
    noise = torch.stack([st.gumbel(3, 0, j, Purpose.DRAFT_SAMPLE, S - m) for j in range(5)])
    kw = dict(temperature=1.0, support=S, rheostat=m, slots=K, proxy="default")
    ref = reference.slot_expansion(logits, parent, noise, **kw)
    runs = [tk.slot_expansion(logits.to(DEV), parent.to(DEV), noise.to(DEV), block=16, **kw) for _ in range(5)]
    same_runs = all(torch.equal(r.sup_token, runs[0].sup_token) and torch.equal(r.sup_q, runs[0].sup_q)
                    for r in runs)
    got = runs[0]
    print(f"[slot] outputs equal across 5 runs: {same_runs}; sup_token equal to the reference per row: "
          f"{[bool(torch.equal(ref.sup_token[i], got.sup_token[i].cpu())) for i in range(5)]}")
    for block in (16, 64):
        g = tk.slot_expansion(logits.to(DEV), parent.to(DEV), noise.to(DEV), block=block, **kw)
        print(f"[slot] block={block}: rows equal {[bool(torch.equal(ref.sup_token[i], g.sup_token[i].cpu())) for i in range(5)]}")
    row = 1
    lr = logits[row]
    print("[slot] row 1: token logit | ref q (hex) | kernel q (hex), in the reference's order")
    kq = dict(zip(got.sup_token[row].tolist(), got.sup_q[row].cpu().tolist()))
    for t, q in zip(ref.sup_token[row].tolist(), ref.sup_q[row].tolist()):
        k = kq.get(t)
        print(f"  {t:3d} {lr[t].item():6.1f} | {float.hex(q)} | {float.hex(k) if k is not None else 'absent'}")
    print("  kernel order (token lane=token%16 q):", " ".join(
        f"{t}:{t % 16}:{float.hex(q)}" for t, q in zip(got.sup_token[row].tolist(), got.sup_q[row].cpu().tolist())))
    # q of every token of the row as the kernel's formula gives it, to see lane effects
    probs = torch.softmax(logits.to(DEV), -1)
    print(f"[slot] torch softmax on {DEV}, row 1 tokens 2, 7, 10, 13, 20, 22, 30: "
          f"{[float.hex(probs[row, t].item()) for t in (2, 7, 10, 13, 20, 22, 30)]}")


def gumbel_ulps() -> None:
    from rheoplan.kernels.noise import gumbel_rows
    from rheoplan.rng import Purpose, Streams

    s = Streams(2**40 + 123)
    trees = torch.tensor([0, 0, 1, 2, 0] * 40)
    nodes = torch.arange(200)
    got = gumbel_rows(s, 11, trees.to(DEV), nodes.to(DEV), Purpose.VERIFY_RESIDUAL, 37, "triton").cpu()
    want = gumbel_rows(s, 11, trees, nodes, Purpose.VERIFY_RESIDUAL, 37, "reference")
    ulp = (got.view(torch.int64) - want.view(torch.int64)).abs()
    print(f"[gumbel] {got.numel()} draws: {int((ulp > 0).sum())} differ; max |ulp| {int(ulp.max())}; "
          f"max rel {float(((got - want).abs() / want.abs().clamp_min(1e-300)).max()):.3g}")


def host_time() -> None:
    from rheoplan.kernels.slot_expansion import triton as stk
    from rheoplan.kernels.tree_attention import triton as atk

    B, Lq, P, V = 1, 61, 1024, 128256
    g = torch.Generator(device=DEV).manual_seed(0)
    qa = torch.randn(B, 32, Lq, 128, device=DEV, dtype=torch.bfloat16, generator=g)
    kc = torch.randn(B, 8, P, 128, device=DEV, dtype=torch.bfloat16, generator=g)
    kt = torch.randn(B, 8, Lq, 128, device=DEV, dtype=torch.bfloat16, generator=g)
    plen = torch.full((B,), P, device=DEV)
    bits = torch.full((B, Lq, 1), -1, dtype=torch.int64, device=DEV)
    logits = torch.randn(10, V, device=DEV, generator=g) * 3
    parent = torch.zeros(10, device=DEV)
    noise = torch.zeros(10, 128, dtype=torch.float64, device=DEV)
    calls = {
        "tree_attention B=1": lambda: atk.tree_attention(qa, kc, kc, kt, kt, plen, bits),
        "slot_expansion 10 rows": lambda: stk.slot_expansion(logits, parent, noise, temperature=1.0, support=128,
                                                             rheostat=1, slots=10),
    }
    for name, fn in calls.items():
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        n = 50
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        t_enq = (time.perf_counter() - t0) / n * 1e6
        torch.cuda.synchronize()
        t_all = (time.perf_counter() - t0) / n * 1e6
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(n):
                fn()
            torch.cuda.synchronize()
        dev = sum(e.self_device_time_total for e in prof.key_averages()) / n
        kern = ", ".join(f"{e.key[:40]} {e.self_device_time_total / n:.1f}" for e in
                         sorted(prof.key_averages(), key=lambda e: -e.self_device_time_total)[:4])
        print(f"[host] {name}: wall {t_all:.1f} us per call back to back (host enqueue {t_enq:.1f}); "
              f"device {dev:.1f} us per call ({kern})")
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        pr.disable()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(8)
        lines = [ln for ln in s.getvalue().splitlines() if ln.strip() and ("{" in ln or ".py" in ln)][:9]
        print("\n".join("    " + ln.strip()[:150] for ln in lines))


def main() -> int:
    if DEV == "cuda" and not torch.cuda.is_available():
        print("gpu_diagnose: no CUDA device; nothing to do (--smoke runs parts 1-2 under the interpreter)")
        return 2
    for part in (tied_slot_expansion, gumbel_ulps) + ((host_time,) if DEV == "cuda" else ()):
        try:
            part()
        except Exception as e:  # one part failing must not hide the others
            print(f"[{part.__name__}] FAILED {type(e).__name__}: {e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
