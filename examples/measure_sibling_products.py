"""Sibling projections as one product: what ``pack_linears(fuse=True)`` saves on this machine.

A Llama layer multiplies the same normed hidden states by its q, k and v projections, and
the same MLP input by its gate and up projections. ``FusedPart`` runs each set as one
product of the concatenated weights (``rheoplan.models.packed_linear``). This script loads
SmolLM2-135M-Instruct as ``rheoplan generate`` does (packed where it pays), then

1. times SmolLM2's first layer's q / k / v and gate / up through the loaded products,
   apart and as one, at 1, 2, 4 and 8 rows (best of 5 x 300 calls, hot in the caches);
2. checks that a verify forward's hidden states are the same bits either way and times
   verify forwards of 1, 4 and 9 tokens at 120 cached tokens, the model packed apart and
   fused in turn, the order alternating per round (median over the rounds).

docs/results.md, "Sibling products as one", quotes it:

    python examples/measure_sibling_products.py [--dtype bfloat16] [--rounds 6] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def best_us(f, reps: int = 300) -> float:
    for _ in range(20):
        f()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(reps):
            f()
        best = min(best, (time.perf_counter() - t0) / reps)
    return 1e6 * best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    ap.add_argument("--rounds", type=int, default=6, help="forward rounds, each set-up once per round (>= 1)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (>= 1)")
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.threads < 1:
        raise SystemExit(f"--rounds={args.rounds} and --threads={args.threads} must be >= 1")
    torch.set_num_threads(args.threads)

    from rheoplan.loading import load_default
    from rheoplan.models import as_target
    from rheoplan.models.packed_linear import SIBLINGS, PackedLinear, _SharedProduct, pack_linears, unpack_linears
    from rheoplan.probe import chain_linear

    model, _, _ = load_default(method="autoregressive", dtype=args.dtype)
    kinds = {(m.onednn, m.few_rows, m.prefill) for m in model.modules() if isinstance(m, PackedLinear)}
    if len(kinds) != 1:
        raise SystemExit(f"the loader packed nothing here ({kinds}): there is nothing to fuse")
    (onednn, few_rows, prefill), = kinds
    print(f"products as loaded: onednn={onednn}, few_rows={few_rows}, prefill={prefill}")

    unpack_linears(model)
    layer = model.model.layers[0]
    print("\none layer's sibling sets, us per set (apart -> one product):")
    with torch.no_grad():
        for parent, names in ((layer.self_attn, SIBLINGS[0]), (layer.mlp, SIBLINGS[1])):
            lins = [getattr(parent, n) for n in names]
            apart = [PackedLinear(m, onednn, few_rows, prefill) for m in lins]
            shared = _SharedProduct(lins, onednn, few_rows, prefill)
            for rows in (1, 2, 4, 8):
                x = torch.randn(rows, lins[0].in_features, dtype=lins[0].weight.dtype)
                a = best_us(lambda: [m(x) for m in apart])
                f = best_us(lambda: [shared.part(x, i) for i in range(len(names))])
                print(f"  {' / '.join(names)}, {rows} rows: {a:.1f} -> {f:.1f}")

    vocab = int(model.config.vocab_size)
    prompt = [(7 * i + 3) % vocab for i in range(121)]
    sizes = (1, 4, 9)

    def target(fuse: bool):
        unpack_linears(model)
        pack_linears(model, onednn=onednn, few_rows=few_rows, prefill=prefill, fuse=fuse)
        tgt = as_target(model)
        tgt.start(prompt)
        return tgt

    with torch.no_grad():
        hidden = {f: [target(f).forward_tree(chain_linear(prompt[-1], 120, n))._hidden.clone() for n in sizes]
                  for f in (False, True)}
    same = all(torch.equal(a, b) for a, b in zip(hidden[False], hidden[True]))
    print(f"\nverify forwards' hidden states, apart and fused: {'the same bits' if same else 'DIFFERENT'}")
    times: dict[tuple[bool, int], list[float]] = {}
    with torch.no_grad():
        for r in range(args.rounds):
            for fuse in ((False, True) if r % 2 == 0 else (True, False)):
                tgt = target(fuse)
                for n in sizes:
                    lin = chain_linear(prompt[-1], 120, n)
                    tgt.forward_tree(lin)  # untimed: the first after a switch
                    for _ in range(5):
                        t0 = time.perf_counter()
                        tgt.forward_tree(lin)
                        times.setdefault((fuse, n), []).append(time.perf_counter() - t0)
    print(f"verify forward at 120 cached tokens, median of {5 * args.rounds}, ms (apart -> fused):")
    for n in sizes:
        a, f = (1e3 * statistics.median(times[(fuse, n)]) for fuse in (False, True))
        print(f"  {n} tokens: {a:.1f} -> {f:.1f} ({f / a:.3f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
