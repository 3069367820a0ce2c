"""Measure what lazy target logits save: verify forward of a 1+47-node tree on SmolLM2-135M.

The verifier's walk visits a handful of nodes, so HFTarget projects only those through
the lm_head (576 x 49152 for SmolLM2). This script times one verify forward over a
200-token cache with logits at every node versus at 5 nodes (a typical walk).

Usage:
    python examples/measure_lazy_logits.py [--reps 9] [--threads 1]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from rheoplan.ir import LinearTree
from rheoplan.models.hf_target import HFTarget
from rheoplan.models.smollm import load_smollm2


def random_linear_tree(n: int, vocab: int, root: int, prefix_len: int, seed: int = 0) -> LinearTree:
    """A random depth-major tree of ``n`` nodes (root included) as a LinearTree, batch 1."""
    rng = random.Random(seed)
    parents, depth = [-1], [0]
    while len(parents) < n:
        p = rng.randrange(len(parents))
        if depth[p] < 7:
            parents.append(p)
            depth.append(depth[p] + 1)
    order = sorted(range(n), key=lambda i: (depth[i], i))
    new = {o: k for k, o in enumerate(order)}
    par = [-1 if parents[o] < 0 else new[parents[o]] for o in order]
    dep = [depth[o] for o in order]
    tok = [root] + [rng.randrange(vocab) for _ in range(n - 1)]
    anc = torch.zeros(1, n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            anc[0, i, j] = True
            j = par[j]
    t = lambda xs: torch.tensor([xs], dtype=torch.int64)  # noqa: E731
    first = [next((c for c in range(n) if par[c] == i), -1) for i in range(n)]
    kids = [sum(1 for c in range(n) if par[c] == i) for i in range(n)]
    # Only the fields the target reads matter here; the rest are filled plausibly.
    return LinearTree(n=torch.tensor([n]), node=t(list(range(n))), token=t(tok),
                      position=t([prefix_len + d for d in dep]), parent=t(par), depth=t(dep),
                      ancestor_mask=anc, ancestor_bits=torch.zeros(1, n, (n + 63) // 64, dtype=torch.int64),
                      paths=torch.full((1, 1, max(dep) + 1), -1), n_paths=torch.tensor([0]),
                      first_child=t(first), n_children=t(kids), exp_row=t([-1] * n))


def interleaved(fns: list, reps: int) -> list[list[float]]:
    """Times of each fn over ``reps`` rounds, every round running each fn once: on a shared
    machine, load changes between rounds hit all variants alike; the min is the best estimate."""
    out = [[] for _ in fns]
    for _ in range(reps):
        for k, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            out[k].append(time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cache", type=int, default=200)
    ap.add_argument("--nodes", type=int, default=48, help="root + drafted nodes")
    ap.add_argument("--visited", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    model, tok = load_smollm2()
    V = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, V, (args.cache + 1,), generator=g).tolist()
    target = HFTarget(model)
    target.start(prompt)  # caches args.cache tokens
    linear = random_linear_tree(args.nodes, V, prompt[-1], args.cache)
    visited = list(range(args.visited))

    def forward_only():
        target.forward_tree(linear)  # a repeated forward replaces the previous tree

    def all_nodes():
        target.forward_tree(linear).all_logits()

    def lazy():
        tl = target.forward_tree(linear)
        for i in visited:
            tl.logits(i)

    def prefetched():
        tl = target.forward_tree(linear)
        tl.prefetch(visited)
        for i in visited:
            tl.logits(i)

    hidden = torch.randn(args.nodes, model.config.hidden_size)
    head = model.get_output_embeddings()

    def head_all():
        with torch.no_grad():
            head(hidden)

    def head_lazy():
        with torch.no_grad():
            for i in visited:
                head(hidden[i])

    def head_batched():
        with torch.no_grad():
            head(hidden[visited])

    for f in (forward_only, all_nodes, lazy, prefetched):
        f()  # warm-up
    rows = [("decoder stack only (no logits)", forward_only), (f"logits at all {args.nodes} nodes", all_nodes),
            (f"logits at {args.visited} nodes (lazy)", lazy),
            (f"logits at {args.visited} nodes (prefetch, batched)", prefetched), (f"lm_head alone, {args.nodes} rows", head_all),
            (f"lm_head alone, {args.visited} rows one by one", head_lazy),
            (f"lm_head alone, {args.visited} rows batched", head_batched)]
    print(f"SmolLM2-135M fp32, cache {args.cache}, tree 1+{args.nodes - 1}, vocab {V}, "
          f"threads {args.threads}, {args.reps} interleaved rounds")
    res = {}
    for (name, _), ts in zip(rows, interleaved([f for _, f in rows], args.reps)):
        res[name] = min(ts)
        print(f"  {name:44s} min {1e3 * min(ts):8.1f} ms   median {1e3 * statistics.median(ts):8.1f} ms")
    a = res[rows[1][0]]
    for name in (rows[2][0], rows[3][0]):
        b = res[name]
        print(f"  saving of '{name}' vs all nodes (min): {1e3 * (a - b):.1f} ms per verify step "
              f"({100 * (a - b) / a:.1f} %)")


if __name__ == "__main__":
    main()
