"""Readable torch reference of the slot-expansion kernel (the ground truth of parity tests).

It is the per-node body of ``planner/expand.py`` plus ``planner/assign.py`` with the
Gumbel noise injected instead of drawn, written with the same helpers
(``rank_support``, ``tail_law``, ``proxy_weight``, ``log_weight``) so it cannot drift.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from rheoplan.config import PROXY_CODES
from rheoplan.distributions import rank_support, tail_law
from rheoplan.planner.expand import log_weight, proxy_weight


class SlotExpansion(NamedTuple):
    """Outputs for ``n`` expanded nodes (``S' = min(support, V)``, ``K`` slots)."""

    sup_token: torch.Tensor  #: [n, S'] int64, ranked by q desc, ties lower id
    sup_q: torch.Tensor  #: [n, S'] float32
    sup_n: torch.Tensor  #: [n] int64 (= S')
    z: torch.Tensor  #: [n] float32, tail mass over ranks m+1..S'
    y_rank: torch.Tensor  #: [n] int64, support index of Y (-1 when m >= K)
    y_token: torch.Tensor  #: [n] int64 (-1 when m >= K)
    y_qtilde: torch.Tensor  #: [n] float32, q~(Y) (0 when m >= K)
    child_token: torch.Tensor  #: [n, K] int64, DET by rank, SAMPLED, PAD by rank
    child_q: torch.Tensor  #: [n, K] float32, true draft q of each child's token
    child_weight: torch.Tensor  #: [n, K] float32 (proxy for the SAMPLED slot)
    child_score: torch.Tensor  #: [n, K] float32, parent_score + log(weight)


def check_args(logits: torch.Tensor, parent_score: torch.Tensor, noise: torch.Tensor,
               support: int, rheostat: int, slots: int, proxy: str) -> None:
    """Shared argument validation (raised before any work, by every implementation)."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [n, V], got shape {tuple(logits.shape)}")
    n, V = logits.shape
    if parent_score.shape != (n,):
        raise ValueError(f"parent_score must be [{n}], got {tuple(parent_score.shape)}")
    s = min(support, V)
    if not 0 <= rheostat <= slots or slots > s:
        raise ValueError(f"need 0 <= rheostat={rheostat} <= slots={slots} <= min(support, V)={s}")
    if rheostat < slots and (noise.dim() != 2 or noise.shape[0] != n or noise.shape[1] < s - rheostat):
        raise ValueError(f"noise must be [{n}, >= {s - rheostat}] (Gumbel per tail index), "
                         f"got {tuple(noise.shape)}")
    if proxy not in PROXY_CODES:
        raise ValueError(f"proxy={proxy!r} is not one of {tuple(PROXY_CODES)}")


def slot_expansion(logits: torch.Tensor, parent_score: torch.Tensor, noise: torch.Tensor, *,
                   temperature: float, support: int, rheostat: int, slots: int,
                   proxy: str = "default") -> SlotExpansion:
    """Expand ``n`` nodes given their draft logits ``[n, V]``.

    ``temperature`` is the draft temperature (``SamplingConfig.draft_temperature``);
    ``rheostat`` the effective m (``slots`` when greedy). ``noise[j, i]`` is the Gumbel
    variable of tail index ``i`` (rank ``m + i``) of node ``j``: pass
    ``Streams.gumbel(step, b, node, Purpose.DRAFT_SAMPLE, S' - m)`` to reproduce the
    pipeline's draw.

    Example:
        >>> out = slot_expansion(torch.tensor([[0., 2., 1.]]), torch.zeros(1), torch.zeros(1, 2),
        ...                      temperature=1.0, support=3, rheostat=1, slots=2)
        >>> out.sup_token.tolist(), out.child_token.tolist()
        ([[1, 2, 0]], [[1, 2]])
    """
    check_args(logits, parent_score, noise, support, rheostat, slots, proxy)
    m, K = rheostat, slots
    q = torch.softmax(logits.to(torch.float32) / temperature, dim=-1)
    sup_token, sup_q = rank_support(q, support)
    n_rows, s = sup_token.shape
    y_rank = torch.full((n_rows,), -1, dtype=torch.int64)
    y_token = torch.full((n_rows,), -1, dtype=torch.int64)
    y_qtilde = torch.zeros(n_rows, dtype=torch.float32)
    z = torch.zeros(n_rows, dtype=torch.float32)
    child_token = torch.full((n_rows, K), -1, dtype=torch.int64)
    child_q = torch.zeros(n_rows, K, dtype=torch.float32)
    child_weight = torch.zeros(n_rows, K, dtype=torch.float32)
    child_score = torch.zeros(n_rows, K, dtype=torch.float32)
    for j in range(n_rows):
        z[j] = float(sup_q[j, m:s].to(torch.float64).sum())
        ranks = list(range(min(m, K)))
        pi = None
        if m < K:
            qt = tail_law(sup_q[j], m, s)
            i = int(torch.argmax(torch.log(qt) + noise[j, : s - m].to(torch.float64)))
            y_rank[j] = m + i
            y_token[j] = sup_token[j, m + i]
            y_qtilde[j] = float(qt[i])
            pi = proxy_weight(proxy, sup_q[j], m, s)
            pads = [r for r in range(m, s) if r != m + i][: K - m - 1]
            ranks = ranks + [m + i] + pads
        base = float(parent_score[j])
        for c, r in enumerate(ranks):
            child_token[j, c] = sup_token[j, r]
            child_q[j, c] = sup_q[j, r]
            w = float(sup_q[j, r]) if (c != m or pi is None) else pi
            child_weight[j, c] = w
            child_score[j, c] = base + log_weight(float(child_weight[j, c]))
    return SlotExpansion(sup_token, sup_q, torch.full((n_rows,), s, dtype=torch.int64), z,
                         y_rank, y_token, y_qtilde, child_token, child_q, child_weight, child_score)
