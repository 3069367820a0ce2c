"""Benchmark the planner and verifier kernels (a script, not a test).

    rheoplan bench kernels                 # CPU: numba vs reference per step
    rheoplan bench kernels --cuda          # + Triton kernels vs torch on CUDA
    rheoplan bench kernels --vocab 49152 --reps 20 --out results.txt

CPU section: one draft-verify step's bookkeeping for a tree of N=60 nodes, depth 8,
frontier 10, slots 10, support 128 (RheoSampling's paper setting), model forwards
excluded: the draft returns precomputed logits, the verifier gets precomputed target
laws. "planner" is the whole pass pipeline (it includes the draft softmax and the top-S
over the vocabulary); "vocab part" is that softmax + top-S alone; "verify" is the walk
with the coupling at every visited node (target laws and noise given).

CUDA section: per-kernel microseconds (CUDA events, median of reps) of the Triton
kernels vs their torch references at batch 1, 8, 64, and tree attention vs SDPA with a
dense mask. ``main(argv)`` lets a CLI call it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from rheoplan.config import SamplingConfig, TreeConfig
from rheoplan.kernels.slot_expansion.cpu import rank_support_rows
from rheoplan.kernels.verify import cpu as vcpu
from rheoplan.kernels.verify import reference as vref
from rheoplan.plan import plan_tree
from rheoplan.verify import node_y


def _time_cpu(fn, reps: int) -> float:
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def _tree_cfg():
    return TreeConfig(depth=8, frontier=10, slots=10, budget=60, rheostat=1, support=128)


def cpu_section(vocabs, reps: int, ref_reps: int, out) -> None:
    cfg, sampling = _tree_cfg(), SamplingConfig(temperature=1.0)
    print(f"# CPU, torch threads={torch.get_num_threads()}; N=60 depth=8 frontier=10 slots=10 S=128, B=1",
          file=out)
    print(f"{'vocab':>7} {'impl':>9} {'planner ms':>11} {'vocab part ms':>14} {'tree bookkeeping ms':>20} "
          f"{'verify ms':>10}", file=out)
    for V in vocabs:
        g = torch.Generator().manual_seed(0)
        bank = torch.randn(1, cfg.frontier, V, generator=g) * 3
        draft = lambda t, nodes: bank[:, : nodes.shape[1]]  # noqa: E731
        step = [0]

        def plan(backend):
            step[0] += 1
            return plan_tree(draft, [1], tree=cfg, sampling=sampling, backend=backend, step=step[0])

        def vocab_part():
            x = torch.softmax(bank[0], dim=-1)
            tok = torch.empty(x.shape[0], 128, dtype=torch.int64).numpy()
            val = torch.empty(x.shape[0], 128).numpy()
            for _ in range(1 + (cfg.depth - 1)):  # root row + 7 frontier batches (approx. 71 rows)
                rank_support_rows(x.numpy(), 128, tok, val)
                x = torch.softmax(bank[0], dim=-1)

        tree = plan("numba")
        lin = tree.linear
        L = lin.token.shape[1]
        p = torch.softmax(torch.randn(1, L, V, generator=g, dtype=torch.float64) * 3, dim=-1)
        u = torch.rand(1, L, generator=g, dtype=torch.float64)
        gum = -torch.log(-torch.log(torch.rand(1, L, V, generator=g, dtype=torch.float64)))
        y = torch.tensor([[node_y(tree, 0, r) for r in range(tree.y_token.shape[1])]])
        vargs = (p, u, gum, lin.token, lin.first_child, lin.n_children, lin.exp_row, tree.sup_token,
                 tree.sup_q, tree.sup_n, y, tree.rheostat, tree.slots, "ot")
        t_vocab = _time_cpu(vocab_part, reps)
        for name, walk, r in (("numba", vcpu.verify_walk, reps), ("reference", vref.verify_walk, ref_reps)):
            t_plan = _time_cpu(lambda: plan(name), r)
            t_verify = _time_cpu(lambda: walk(*vargs), r)
            vp = f"{1e3 * t_vocab:14.2f}" if name == "numba" else f"{'-':>14}"
            tb = f"{1e3 * (t_plan - t_vocab):20.2f}" if name == "numba" else f"{'-':>20}"
            print(f"{V:>7} {name:>9} {1e3 * t_plan:11.2f} {vp} {tb} {1e3 * t_verify:10.2f}", file=out)
        out.flush()


def _time_cuda(fn, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) * 1e3)
    return statistics.median(ts)


def cuda_section(vocab: int, reps: int, out, device: str = "cuda", batches=(1, 8, 64), prefix: int = 1024,
                 heads=((32, 8, 128), (9, 3, 64))) -> None:
    """Per-kernel CUDA-event times. Every input is made on the device before the clock starts
    (no host-to-device copy inside a timed call); p and the noise are float32, as the decode
    loop hands them over (the kernels upcast in registers). ``device="cpu"`` (with
    ``TRITON_INTERPRET=1``) runs the same code at toy sizes: a smoke test, not a timing."""
    # Triton kernels: imported only when a GPU section runs.
    from rheoplan.kernels.plan import reference as pref, triton as ptk
    from rheoplan.kernels.slot_expansion import triton as stk
    from rheoplan.kernels.tree_attention import reference as aref, triton as atk
    from rheoplan.kernels.verify import triton as vtk

    dev = device
    cfg = _tree_cfg()
    name = torch.cuda.get_device_name() if dev == "cuda" else "cpu (interpreter smoke run)"
    timer = _time_cuda if dev == "cuda" else (lambda fn, r: 1e6 * _time_cpu(fn, r))
    print(f"\n# CUDA {name}; vocab={vocab}; median us over {reps} reps", file=out)
    print(f"{'kernel':<26} {'batch':>5} {'triton us':>10} {'torch ref us':>13}", file=out)
    for B in batches:
        g = torch.Generator(device=dev).manual_seed(B)
        n = B * cfg.frontier
        logits = torch.randn(n, vocab, generator=g, device=dev) * 3
        parent = torch.zeros(n, device=dev)
        noise = torch.zeros(n, 128, dtype=torch.float64, device=dev)
        kw = dict(temperature=1.0, support=128, rheostat=1, slots=10)
        t_k = timer(lambda: stk.slot_expansion(logits, parent, noise, **kw), reps)
        t_r = timer(lambda: torch.topk(torch.softmax(logits, -1), 128, dim=-1), reps)
        print(f"{'slot_expansion':<26} {B:>5} {t_k:10.1f} {t_r:13.1f}  (ref: torch softmax + topk only)", file=out)
        # the same without the vocabulary split (one program per row): what the split buys
        t_1 = timer(lambda: stk.slot_expansion(logits, parent, noise, chunks=1, **kw), reps)
        print(f"{'slot_expansion chunks=1':<26} {B:>5} {t_1:10.1f} {'':>13}  (split here: "
              f"{stk.default_chunks(n, vocab, 128, logits.device)} chunks)", file=out)
        cpu_bank = torch.randn(64, 512, generator=torch.Generator().manual_seed(B))
        tree = plan_tree(lambda t, nd: cpu_bank[(nd.clamp(min=0) + t.cur_depth) % 64], list(range(B)), tree=cfg,
                         sampling=SamplingConfig())
        d = lambda x: x.to(dev)  # noqa: E731
        score, n_nodes = d(tree.score), d(tree.n_nodes)
        t_k = timer(lambda: ptk.prune_topn(score, n_nodes, 60), reps)
        t_r = timer(lambda: pref.prune_topn(tree.score, tree.n_nodes, 60), max(3, reps // 10))
        print(f"{'prune_topn':<26} {B:>5} {t_k:10.1f} {t_r:13.1f}  (ref on CPU)", file=out)
        la = (d(tree.kept), d(tree.n_nodes), d(tree.parent), d(tree.token), d(tree.depth), d(tree.exp_row),
              d(tree.prefix_len))
        t_k = timer(lambda: ptk.linearize(*la, 60, 8, trim_paths=False), reps)
        print(f"{'linearize (no host sync)':<26} {B:>5} {t_k:10.1f} {'-':>13}", file=out)
        p = torch.softmax(torch.randn(n, vocab, generator=g, device=dev), -1)
        tok = torch.arange(128, device=dev).repeat(n, 1)
        q = torch.full((n, 128), 1 / 128, device=dev)
        sn = torch.full((n,), 128, device=dev)
        yy = torch.full((n,), 5, device=dev)
        u = torch.rand(n, dtype=torch.float64, generator=g, device=dev)
        gg = torch.randn(n, vocab, generator=g, device=dev)
        t_k = timer(lambda: vtk.coupling_rows(p, tok, q, sn, 1, 10, yy, "ot", u, gg), reps)
        print(f"{'coupling_rows (ot)':<26} {B:>5} {t_k:10.1f} {'-':>13}", file=out)
        lin = tree.linear
        Lw = lin.token.shape[1]
        pw = torch.softmax(torch.randn(B, Lw, vocab, generator=g, device=dev) * 3, -1)
        y = torch.tensor([[node_y(tree, b, r) for r in range(tree.y_token.shape[1])] for b in range(B)])
        wargs = [pw, None, None, d(lin.token), d(lin.first_child), d(lin.n_children), d(lin.exp_row),
                 d(tree.sup_token), d(tree.sup_q), d(tree.sup_n), d(y), tree.rheostat, tree.slots, "ot"]
        noise_w = vtk.WalkNoise(7, 1, d(lin.node), torch.arange(B, device=dev), 2, 3)
        t_k = timer(lambda: vtk.verify_walk(*wargs, noise=noise_w), reps)
        print(f"{'verify_walk (noise in kernel)':<26} {B:>5} {t_k:10.1f} {'-':>13}", file=out)
        Lq, P = 61, prefix
        bits = torch.full((B, Lq, 1), -1, dtype=torch.int64, device=dev)  # every node sees every node
        plen = torch.full((B,), P, device=dev)
        for Hq, Hkv, dh in heads:
            qa = torch.randn(B, Hq, Lq, dh, device=dev, dtype=torch.bfloat16)
            kc = torch.randn(B, Hkv, P, dh, device=dev, dtype=torch.bfloat16)
            kt = torch.randn(B, Hkv, Lq, dh, device=dev, dtype=torch.bfloat16)
            t_k = timer(lambda: atk.tree_attention(qa, kc, kc, kt, kt, plen, bits), reps)
            # the reference's cost without building its mask: SDPA on the dense mask made once
            mask = aref.dense_mask(plen, bits, P)[:, None]
            kk = torch.cat([kc, kt], 2).repeat_interleave(Hq // Hkv, 1)
            t_r = timer(lambda: torch.nn.functional.scaled_dot_product_attention(qa, kk, kk, attn_mask=mask),
                             reps)
            print(f"{'tree_attention bf16':<26} {B:>5} {t_k:10.1f} {t_r:13.1f}  (SDPA, dense mask; P={P} Hq={Hq} "
                  f"Hkv={Hkv} d={dh})", file=out)
        out.flush()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="rheoplan bench kernels", description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, nargs="*", default=[256, 49152, 128256],
                    help="vocab sizes; 256 ~ the tree bookkeeping alone (vocab work negligible)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--ref-reps", type=int, default=1, help="reps of the (slow) torch reference pipeline")
    ap.add_argument("--cuda", action="store_true", help="also run the CUDA section (needs a GPU)")
    ap.add_argument("--no-cpu", action="store_true")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (default 1: the planner's ops are tiny, and on a busy machine "
                         "OpenMP waits for descheduled threads cost milliseconds per op)")
    ap.add_argument("--out", default=None, help="append results to this file (default: stdout)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    out = open(args.out, "a") if args.out else sys.stdout
    try:
        if not args.no_cpu:
            cpu_section(args.vocab, args.reps, args.ref_reps, out)
        if args.cuda:
            if not torch.cuda.is_available():
                print("--cuda: no CUDA device; skipped", file=out)
            else:
                cuda_section(max(args.vocab), args.reps, out)
    finally:
        if out is not sys.stdout:
            out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
