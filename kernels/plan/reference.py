"""Torch reference of the planner bookkeeping kernels, built from the planner's own code."""

from __future__ import annotations

from typing import NamedTuple

import torch

from rheoplan.ir import rank_key_order
from rheoplan.planner.linearize import linearize_arrays


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
    """Depth-major BFS linearisation of the kept nodes: the planner's own code."""
    lin = linearize_arrays(kept, n_nodes, parent, token, depth, exp_row, prefix_len, budget, max_depth)
    return Linear(*(getattr(lin, f) for f in Linear._fields))
