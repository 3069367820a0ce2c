"""Torch reference: SDPA with a dense boolean mask built from the prefix lengths and bits."""

from __future__ import annotations

import torch

from rheoplan.planner.linearize import unpack_bits


def dense_mask(prefix_len: torch.Tensor, ancestor_bits: torch.Tensor, P: int) -> torch.Tensor:
    """``[B, L, P + L]`` bool: column ``j < P`` is cached position ``j`` (visible iff
    ``j < prefix_len``); column ``P + c`` is tree node ``c`` (visible iff ancestor or self).

    Example: prefix_len [1], P = 2, bits [[1], [3]] -> [[T, F, T, F], [T, F, T, T]].
    """
    B, L, _ = ancestor_bits.shape
    pre = torch.arange(P, device=prefix_len.device)[None, None, :] < prefix_len[:, None, None]
    tree = unpack_bits(ancestor_bits.cpu(), L).to(ancestor_bits.device)
    return torch.cat([pre.expand(B, L, P), tree], dim=-1)


def tree_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k_tree: torch.Tensor,
                   v_tree: torch.Tensor, prefix_len: torch.Tensor, ancestor_bits: torch.Tensor,
                   scale: float | None = None) -> torch.Tensor:
    """``out [B, Hq, L, d]`` for queries ``q [B, Hq, L, d]`` over cached ``k/v_cache
    [B, Hkv, P, d]`` (first ``prefix_len[b]`` valid) and the tree's own ``k/v_tree
    [B, Hkv, L, d]``; ``Hq`` a multiple of ``Hkv`` (query head h reads kv head
    ``h // (Hq / Hkv)``). Rows with nothing visible come out 0 (SDPA would give NaN, which
    the next layer would spread to every row that reads that row's keys and values)."""
    B, Hq, L, d = q.shape
    Hkv, P = k_cache.shape[1], k_cache.shape[2]
    g = Hq // Hkv
    k = torch.cat([k_cache, k_tree], dim=2).repeat_interleave(g, dim=1)
    v = torch.cat([v_cache, v_tree], dim=2).repeat_interleave(g, dim=1)
    mask = dense_mask(prefix_len, ancestor_bits, P)[:, None]
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return torch.where(mask.any(-1, keepdim=True), out, torch.zeros((), dtype=out.dtype, device=out.device))
