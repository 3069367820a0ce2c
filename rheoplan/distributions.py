"""Processed target and draft distributions (RHEOSAMPLING.md §2)."""

from __future__ import annotations

import torch

from rheoplan.config import SamplingConfig


#: the message of a broken target output
BROKEN_TARGET = ("target logits contain NaN or +inf, or a row with no finite entry: "
                 "the target model's output is broken")


def target_probs(logits: torch.Tensor, sampling: SamplingConfig, check: bool = True) -> torch.Tensor:
    """The processed target law ``softmax(top_p(top_k(logits / T)))`` in float64.

    ``T = 0`` gives a one-hot on the argmax (ties: lowest token id). Top-k keeps the
    ``k`` best tokens by rank (value descending, ties lower id); top-p then keeps the
    shortest rank prefix whose mass reaches ``top_p`` (at least one token).
    Works on ``[..., V]``. ``check=False`` skips the broken-output check (a host sync);
    the caller checks ``broken_rows`` itself (the device walk sends it with the tokens).

    Example:
        >>> target_probs(torch.tensor([0., 1., 1.]), SamplingConfig(temperature=0)).tolist()
        [0.0, 1.0, 0.0]
    """
    x = logits.to(torch.float64)
    if check and bool(broken_rows(x)):
        raise ValueError(BROKEN_TARGET)
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


#: the message of a broken draft output (raised at once, or after the step on a device)
BROKEN_DRAFT = ("draft logits contain NaN or +inf, or a row with no finite entry: "
                "the draft model's output is broken")

#: residual mass at or below this is treated as zero (acceptance is then certain); every
#: verifier implementation (torch, numba, Triton) imports it from here
RESIDUAL_EPS = 1e-300


def broken_rows(x: torch.Tensor) -> torch.Tensor:
    """0-d bool tensor: some row of ``x [..., V]`` has NaN or +inf, or no finite entry.
    A tensor, not a bool, so a device caller can defer the host sync."""
    return torch.isnan(x).any() | (x == float("inf")).any() | ~torch.isfinite(x).any(dim=-1).all()


def draft_probs(logits: torch.Tensor, sampling: SamplingConfig, check: bool = True) -> torch.Tensor:
    """Draft law ``softmax(logits / T_d)`` in float32, ``T_d = T`` (1 when greedy).

    ``check=False`` skips the broken-output check (a host sync); the caller then checks
    ``broken_rows`` itself (the Triton planner defers it to the end of planning).
    """
    x = logits.to(torch.float32)
    if check and bool(broken_rows(x)):
        raise ValueError(BROKEN_DRAFT)
    T = sampling.draft_temperature
    return torch.softmax(x if T == 1.0 else x / T, dim=-1)  # x / 1 is exact: skipping it changes no bit


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


def tail_mass(sup_q: torch.Tensor, m: int, n: int) -> torch.Tensor:
    """``z`` = mass of ranks ``m+1..n`` of each row of ``sup_q [R, S]``, float64 ``[R]``.

    Every implementation sums with this torch reduction: a sequential loop rounds
    differently in the last bit now and then.
    """
    return sup_q[..., m:n].to(torch.float64).sum(dim=-1)


def tail_law_rows(sup_q: torch.Tensor, m: int, n: int) -> torch.Tensor:
    """``tail_law`` for every row of ``sup_q [R, S]`` at once: ``[R, n - m]`` float64."""
    tail = sup_q[..., m:n].to(torch.float64)
    z = tail_mass(sup_q, m, n).unsqueeze(-1)
    return torch.where(z > 0, tail / torch.where(z > 0, z, 1.0), 1.0 / max(n - m, 1))


def tail_law(sup_q: torch.Tensor, m: int, n: int) -> torch.Tensor:
    """The sampled slot's exact proposal law q~ over ranks ``m+1..n`` (float64, sums to 1).

    ``sup_q`` is one expanded node's ranked support probabilities. If the tail has no
    mass (the top ``m`` hold all of it), q~ is uniform over the tail: any fixed law is
    lossless as long as drafting and verification use the same one, which they do by
    both calling this function.

    Example: sup_q [0.5, 0.3, 0.2], m = 1 -> [0.6, 0.4] (for ranks 2 and 3).
    """
    return tail_law_rows(sup_q[None], m, n)[0]
