"""Torch reference of the verification kernels: loops over ``rheoplan.verify.coupling_sample``."""

from __future__ import annotations

from typing import NamedTuple

import torch

from rheoplan.verify import coupling_sample


def coupling_rows(p: torch.Tensor, sup_token: torch.Tensor, sup_q: torch.Tensor, sup_n: torch.Tensor,
                  m: int, K: int, y_token: torch.Tensor, verifier: str, u_accept: torch.Tensor,
                  gumbel: torch.Tensor) -> torch.Tensor:
    """Emitted token ``X [n]`` for ``n`` nodes.

    ``p [n, V]`` processed target law (float64); ``sup_token/sup_q [n, S]``, ``sup_n [n]``,
    ``y_token [n]`` (-1: no sampled slot, then ``X ~ p``) are the node's expansion tables;
    ``u_accept [n]`` and ``gumbel [n, V]`` the injected randomness.

    Example:
        >>> p = torch.tensor([[0.2, 0.5, 0.3]], dtype=torch.float64)
        >>> coupling_rows(p, torch.tensor([[0, 1, 2]]), torch.tensor([[.5, .3, .2]]), torch.tensor([3]),
        ...               1, 2, torch.tensor([1]), "rheo", torch.tensor([0.1]), torch.zeros(1, 3)).tolist()
        [1]
    """
    out = torch.empty(p.shape[0], dtype=torch.int64)
    for j in range(p.shape[0]):
        out[j] = coupling_sample(p[j], sup_token[j], sup_q[j], int(sup_n[j]), m, K, int(y_token[j]),
                                 verifier, float(u_accept[j]), gumbel[j])
    return out


class WalkOut(NamedTuple):
    emitted: torch.Tensor  #: [B, L] int64: accepted draft tokens then one more, -1 padded
    n_emitted: torch.Tensor  #: [B] int64
    path: torch.Tensor  #: [B, L] int64 linear indices (root first), -1 padded


def verify_walk(p: torch.Tensor, u_accept: torch.Tensor, gumbel: torch.Tensor, token: torch.Tensor,
                first_child: torch.Tensor, n_children: torch.Tensor, exp_row: torch.Tensor,
                sup_token: torch.Tensor, sup_q: torch.Tensor, sup_n: torch.Tensor, y_token: torch.Tensor,
                m: int, K: int, verifier: str) -> WalkOut:
    """The verification walk of ``rheoplan.verify.walk`` over ``B`` linearised trees.

    ``p [B, L, V]`` is the processed target law at every linear node; ``u_accept [B, L]``
    and ``gumbel [B, L, V]`` the randomness at every linear node (the walk reads only the
    nodes it visits); ``token/first_child/n_children/exp_row [B, L]`` come from
    ``LinearTree``; ``sup_*``/``y_token`` from the ``DraftTree`` expansion tables
    (``y_token`` already with the phantom rule applied).
    """
    B, L, _ = p.shape
    D1 = L  # a walk visits at most L nodes
    emitted = torch.full((B, D1), -1, dtype=torch.int64)
    path = torch.full((B, D1), -1, dtype=torch.int64)
    n_emitted = torch.zeros(B, dtype=torch.int64)
    for b in range(B):
        i, k = 0, 0
        while True:
            path[b, k] = i
            row = int(exp_row[b, i])
            if row < 0:
                x = int(torch.argmax(torch.log(p[b, i]) + gumbel[b, i].to(torch.float64)))
            else:
                x = coupling_sample(p[b, i], sup_token[b, row], sup_q[b, row], int(sup_n[b, row]), m, K,
                                    int(y_token[b, row]), verifier, float(u_accept[b, i]), gumbel[b, i])
            emitted[b, k] = x
            k += 1
            f, nc = int(first_child[b, i]), int(n_children[b, i])
            nxt = [c for c in range(f, f + nc) if f >= 0 and int(token[b, c]) == x]
            if not nxt:
                break
            i = nxt[0]
        n_emitted[b] = k
    return WalkOut(emitted, n_emitted, path)
