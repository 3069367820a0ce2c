"""Torch reference of the planner bookkeeping kernels, built from the planner's own code."""

from __future__ import annotations

from typing import NamedTuple

import torch

from rheoplan.ir import rank_key_order
from rheoplan.planner.linearize import pack_bits


class Linear(NamedTuple):
    """The ``LinearTree`` fields, in ``LinearTree`` order (``LinearTree(*linear)`` works)."""

    n: torch.Tensor
    node: torch.Tensor
    token: torch.Tensor
    position: torch.Tensor
    parent: torch.Tensor
    depth: torch.Tensor
    ancestor_mask: torch.Tensor
    ancestor_bits: torch.Tensor
    paths: torch.Tensor
    n_paths: torch.Tensor
    first_child: torch.Tensor
    n_children: torch.Tensor
    exp_row: torch.Tensor


def frontier_topk(score: torch.Tensor, depth: torch.Tensor, n_nodes: torch.Tensor, level: int,
                  k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` best node ids at depth ``level`` of each tree: ``(nodes [B, k] -1 padded,
    count [B])``, best first.

    Example: scores [0, -1, -.5, -.5] at depths [0, 1, 1, 1], k = 2 -> nodes [[2, 3]].
    """
    B = score.shape[0]
    nodes = torch.full((B, k), -1, dtype=torch.int64)
    count = torch.zeros(B, dtype=torch.int64)
    for b in range(B):
        n = int(n_nodes[b])
        ids = torch.nonzero(depth[b, :n] == level).flatten()
        best = ids[rank_key_order(score[b, ids], ids)[:k]]
        nodes[b, : best.numel()] = best
        count[b] = best.numel()
    return nodes, count


def prune_topn(score: torch.Tensor, n_nodes: torch.Tensor, budget: int) -> torch.Tensor:
    """``kept [B, M]`` bool: the root and the ``budget`` best nodes of ids ``1..n-1``."""
    kept = torch.zeros(score.shape, dtype=torch.bool)
    for b in range(score.shape[0]):
        ids = torch.arange(1, int(n_nodes[b]), dtype=torch.int64)
        kept[b, ids[rank_key_order(score[b, ids], ids)[:budget]]] = True
        kept[b, 0] = True
    return kept


def linearize(kept: torch.Tensor, n_nodes: torch.Tensor, parent: torch.Tensor, token: torch.Tensor,
              depth: torch.Tensor, exp_row: torch.Tensor, prefix_len: torch.Tensor, budget: int,
              max_depth: int) -> Linear:
    """Depth-major BFS linearisation of the kept nodes (``planner/linearize.py``)."""
    B = kept.shape[0]
    L, D = 1 + budget, max_depth
    node = torch.full((B, L), -1, dtype=torch.int64)
    tok, pos, par, dep, erow, first = (node.clone() for _ in range(6))
    n_children = torch.zeros(B, L, dtype=torch.int64)
    mask = torch.zeros(B, L, L, dtype=torch.bool)
    n = torch.zeros(B, dtype=torch.int64)
    all_paths = []
    for b in range(B):
        ids = torch.nonzero(kept[b, : int(n_nodes[b])]).flatten()
        k = ids.numel()
        n[b] = k
        lin_of = {int(v): i for i, v in enumerate(ids)}
        node[b, :k], tok[b, :k], dep[b, :k] = ids, token[b, ids], depth[b, ids]
        pos[b, :k] = prefix_len[b] + depth[b, ids]
        erow[b, :k] = exp_row[b, ids]
        for i, v in enumerate(ids.tolist()):
            pv = int(parent[b, v])
            par[b, i] = lin_of[pv] if pv >= 0 else -1
            if pv >= 0:
                mask[b, i] = mask[b, lin_of[pv]]
                if first[b, lin_of[pv]] < 0:
                    first[b, lin_of[pv]] = i
                n_children[b, lin_of[pv]] += 1
            mask[b, i, i] = True
        paths = []
        for leaf in [i for i in range(k) if n_children[b, i] == 0]:
            p, i = [], leaf
            while i >= 0:
                p.append(i)
                i = int(par[b, i])
            paths.append(p[::-1])
        all_paths.append(paths)
    P = max(len(p) for p in all_paths)
    paths_t = torch.full((B, P, D + 1), -1, dtype=torch.int64)
    for b, paths in enumerate(all_paths):
        for j, p in enumerate(paths):
            paths_t[b, j, : len(p)] = torch.tensor(p)
    return Linear(n, node, tok, pos, par, dep, mask, pack_bits(mask), paths_t,
                  torch.tensor([len(p) for p in all_paths], dtype=torch.int64), first, n_children, erow)
