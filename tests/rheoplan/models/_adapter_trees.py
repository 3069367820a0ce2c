"""Small tree builders for the adapter tests (independent of planner/, which is not used here).

``parents`` lists, per node in creation order, the parent's id (-1 for the root); parents
precede children, so creation order is also a valid linear order.
"""

from __future__ import annotations

import random

import torch

from rheoplan.ir import DraftTree, LinearTree, NodeKind, empty_tree


def depths_of(parents: list[int]) -> list[int]:
    d = []
    for p in parents:
        d.append(0 if p < 0 else d[p] + 1)
    return d


def make_linear(tokens: list[int], parents: list[int], prefix_len: int, pad: int = 0) -> LinearTree:
    """LinearTree (B = 1) with node i = linear index i; ``pad`` extra padded slots."""
    n = len(tokens)
    L = n + pad
    dep = depths_of(parents)
    anc = torch.zeros(1, L, L, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            anc[0, i, j] = True
            j = parents[j]
    W = (L + 63) // 64
    bits = torch.zeros(1, L, W, dtype=torch.int64)
    for i in range(L):
        for j in range(L):
            if anc[0, i, j]:
                w, b = divmod(j, 64)
                v = int(bits[0, i, w]) | (1 << b)
                bits[0, i, w] = v - (1 << 64) if v >= (1 << 63) else v
    kids = [[c for c in range(n) if parents[c] == i] for i in range(n)]
    leaves = [i for i in range(n) if not kids[i]]
    D = max(dep) + 1
    paths = torch.full((1, max(len(leaves), 1), D), -1, dtype=torch.int64)
    for r, leaf in enumerate(leaves):
        chain, j = [], leaf
        while j >= 0:
            chain.append(j)
            j = parents[j]
        for c, v in enumerate(reversed(chain)):
            paths[0, r, c] = v

    def padded(vals, fill):
        return torch.tensor([vals + [fill] * pad], dtype=torch.int64)

    return LinearTree(
        n=torch.tensor([n]), node=padded(list(range(n)), -1), token=padded(tokens, -1),
        position=padded([prefix_len + d for d in dep], -1), parent=padded(parents, -1),
        depth=padded(dep, -1), ancestor_mask=anc, ancestor_bits=bits, paths=paths,
        n_paths=torch.tensor([len(leaves)]),
        first_child=padded([k[0] if k else -1 for k in kids], -1),
        n_children=padded([len(k) for k in kids], 0), exp_row=padded([-1] * n, -1))


def make_draft_tree(tokens: list[int], parents: list[int], prefix_len: int,
                    capacity: int | None = None) -> DraftTree:
    """DraftTree (B = 1) holding exactly these nodes (creation ids = list order)."""
    n = len(tokens)
    M = capacity or n
    t = empty_tree(1, M, 1, 1, torch.tensor([tokens[0]]), torch.tensor([prefix_len]), 1, 1)
    dep = depths_of(parents)
    for i in range(1, n):
        t.parent[0, i] = parents[i]
        t.depth[0, i] = dep[i]
        t.token[0, i] = tokens[i]
        t.kind[0, i] = int(NodeKind.DET)
        t.kept[0, i] = True
    t.n_nodes[0] = n
    return t.replace(cur_depth=max(dep))


def random_tree(rng: random.Random, n: int, vocab: int, root: int,
                max_children: int = 3) -> tuple[list[int], list[int]]:
    """Random tree of ``n`` nodes (root included), parents before children, BFS-like ids."""
    parents, tokens = [-1], [root]
    used: dict[int, set[int]] = {0: set()}
    while len(parents) < n:
        p = rng.randrange(len(parents))
        if len(used[p]) >= min(max_children, vocab):
            continue
        tok = rng.randrange(vocab)
        if tok in used[p]:
            continue
        used[p].add(tok)
        used[len(parents)] = set()
        parents.append(p)
        tokens.append(tok)
    # Renumber depth-major so ids are creation order (depth by depth), as the IR promises.
    dep = depths_of(parents)
    order = sorted(range(n), key=lambda i: (dep[i], i))
    new_id = {old: k for k, old in enumerate(order)}
    return ([tokens[o] for o in order],
            [-1 if parents[o] < 0 else new_id[parents[o]] for o in order])


def path_of(parents: list[int], i: int) -> list[int]:
    out = []
    while i >= 0:
        out.append(i)
        i = parents[i]
    return out[::-1]
