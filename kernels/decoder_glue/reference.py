"""Reference of the decoder's glue: transformers' Llama formulas as torch operations.

``rms_norm`` is ``LlamaRMSNorm.forward`` (widen to float32, ``pow(2).mean``, ``rsqrt`` of
the variance plus epsilon, the product, narrow back, times the weight); ``rope`` is
``apply_rotary_pos_emb`` on one tensor as ``rheoplan.models.lean_llama`` writes it (its
``rotate_half(x) * sin`` as ``roll(x) * sin`` with the first half of ``sin`` negated: the
same float operations on every entry). Each operation rounds to the input's dtype as
torch's does, which is what ``cpu`` reproduces.
"""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``LlamaRMSNorm(weight, eps)(x)`` over the last axis."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def add_rms_norm(hidden: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(hidden + delta, rms_norm(hidden + delta))``: a decoder layer's residual sum and the
    next norm of it."""
    s = hidden + delta
    return s, rms_norm(s, weight, eps)


def rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, head_dim: int) -> torch.Tensor:
    """The rotary embedding of ``x [..., heads * head_dim]`` (every head of a token rotated
    by that token's ``cos`` / ``signed_sin [..., head_dim]``; ``signed_sin`` is ``sin``
    with its first half negated): ``x * cos + roll(x, head_dim / 2) * signed_sin`` per
    head, each product and the sum rounded to ``x``'s dtype. Returns a new contiguous
    tensor of ``x``'s shape."""
    heads = x.unflatten(-1, (-1, head_dim))
    out = heads * cos.unsqueeze(-2) + heads.roll(head_dim // 2, dims=-1) * signed_sin.unsqueeze(-2)
    return out.flatten(-2)


def rope_qkv_append(qkv: torch.Tensor, q_heads: int, cos: torch.Tensor, signed_sin: torch.Tensor, head_dim: int,
                    key_buf: torch.Tensor, value_buf: torch.Tensor, at: int) -> torch.Tensor:
    """A layer's queries, keys and values from its q | k | v product ``qkv [B, T, (q_heads
    + 2 kv_heads) * head_dim]`` up to the attention (``kv_heads`` is the buffers'):
    returns ``rope`` of the queries (a new contiguous ``[B, T, q_heads * head_dim]``);
    writes ``rope`` of the keys and the values, split into heads, into ``key_buf`` /
    ``value_buf [B, kv_heads, columns, head_dim]`` at columns ``at`` to ``at + T`` (a KV
    cache's append, ``rheoplan.models.growing_cache``)."""
    tokens = qkv.shape[1]
    wq, wk = q_heads * head_dim, key_buf.shape[1] * head_dim
    keys = rope(qkv[..., wq:wq + wk], cos, signed_sin, head_dim).unflatten(-1, (-1, head_dim)).transpose(1, 2)
    key_buf[:, :, at:at + tokens] = keys
    value_buf[:, :, at:at + tokens] = qkv[..., wq + wk:].unflatten(-1, (-1, head_dim)).transpose(1, 2)
    return rope(qkv[..., :wq], cos, signed_sin, head_dim)
