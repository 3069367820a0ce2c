"""Processed target and draft distributions (docs/method.md §2)."""

from __future__ import annotations

import torch

from rheoplan.config import SamplingConfig


def target_probs(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """The processed target law ``softmax(top_p(top_k(logits / T)))`` in float64.

    ``T = 0`` gives a one-hot on the argmax (ties: lowest token id). Top-k keeps the
    ``k`` best tokens by rank (value descending, ties lower id); top-p then keeps the
    shortest rank prefix whose mass reaches ``top_p`` (at least one token).
    Works on ``[..., V]``.

    Example:
        >>> target_probs(torch.tensor([0., 1., 1.]), SamplingConfig(temperature=0)).tolist()
        [0.0, 1.0, 0.0]
    """
    x = logits.to(torch.float64)
    if not torch.isfinite(x).any(dim=-1).all() or torch.isnan(x).any() or (x == float("inf")).any():
        raise ValueError("target logits contain NaN or +inf, or a row with no finite entry: "
                         "the target model's output is broken")
    if sampling.greedy:
        out = torch.zeros_like(x)
        out.scatter_(-1, x.argmax(dim=-1, keepdim=True), 1.0)
        return out
    x = x / sampling.temperature
    V = x.shape[-1]
    if not (0 < sampling.top_k < V) and sampling.top_p >= 1.0:
        return torch.softmax(x, dim=-1)  # no filter: skip the full-vocabulary sort
    order = torch.sort(x, dim=-1, descending=True, stable=True).indices
    ranked = torch.gather(x, -1, order)
    keep = torch.ones_like(ranked, dtype=torch.bool)
    if 0 < sampling.top_k < V:
        keep[..., sampling.top_k:] = False
    if sampling.top_p < 1.0:
        pr = torch.softmax(ranked.masked_fill(~keep, float("-inf")), dim=-1)
        before = torch.cumsum(pr, dim=-1) - pr  # mass strictly before each rank
        keep &= before < sampling.top_p
    ranked = ranked.masked_fill(~keep, float("-inf"))
    out = torch.empty_like(x)
    out.scatter_(-1, order, torch.softmax(ranked, dim=-1))
    return out


def draft_probs(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """Draft law ``softmax(logits / T_d)`` in float32, ``T_d = T`` (1 when greedy)."""
    x = logits.to(torch.float32)
    if torch.isnan(x).any() or (x == float("inf")).any() or not torch.isfinite(x).any(dim=-1).all():
        raise ValueError("draft logits contain NaN or +inf, or a row with no finite entry: "
                         "the draft model's output is broken")
    return torch.softmax(x / sampling.draft_temperature, dim=-1)


def rank_support(q: torch.Tensor, support: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``support`` tokens of each row of ``q [n, V]`` by q descending, ties lower id.

    Returns ``(tokens [n, S'], q [n, S'])`` with ``S' = min(support, V)``.
    """
    V = q.shape[-1]
    s = min(support, V)
    if 4 * s >= V:
        vals, idx = torch.sort(q, dim=-1, descending=True, stable=True)
        return idx[..., :s].contiguous(), vals[..., :s].contiguous()
    # Large vocabularies: a full stable sort of V entries is the planner's hot spot. Same
    # result, cheaper: every top-s entry is >= the s-th largest value, so stable-sorting
    # just the entries >= that value (all boundary ties included) gives the same ranks.
    kth = torch.topk(q, s, dim=-1).values[..., -1:]
    c = int((q >= kth).sum(dim=-1).max())
    cand_q, cand_i = torch.topk(q, c, dim=-1)  # holds every entry >= kth, in any order
    by_id = torch.argsort(cand_i, dim=-1)
    cand_q, cand_i = torch.gather(cand_q, -1, by_id), torch.gather(cand_i, -1, by_id)
    order = torch.sort(cand_q, dim=-1, descending=True, stable=True).indices[..., :s]
    return torch.gather(cand_i, -1, order).contiguous(), torch.gather(cand_q, -1, order).contiguous()


def tail_law(sup_q: torch.Tensor, m: int, n: int) -> torch.Tensor:
    """The sampled slot's exact proposal law q~ over ranks ``m+1..n`` (float64, sums to 1).

    ``sup_q`` is one expanded node's ranked support probabilities. If the tail has no
    mass (the top ``m`` hold all of it), q~ is uniform over the tail: any fixed law is
    lossless as long as drafting and verification use the same one, which they do by
    both calling this function.

    Example: sup_q [0.5, 0.3, 0.2], m = 1 -> [0.6, 0.4] (for ranks 2 and 3).
    """
    tail = sup_q[m:n].to(torch.float64)
    z = tail.sum()
    if z <= 0:
        return torch.full_like(tail, 1.0 / tail.numel())
    return tail / z
