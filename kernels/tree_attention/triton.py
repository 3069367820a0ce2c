"""Triton tree attention (same signature as ``reference.tree_attention``).

Grid: (B * Hq, ceil(L / BLOCK_M)). Each program streams the cached prefix in BLOCK_N
tiles (masked by ``prefix_len``), then the tree block (masked by the ancestor bit of
column ``c``: bit ``c % 64`` of word ``c // 64`` of the query's row), with an online
softmax in float32. Grouped-query heads read kv head ``h // GROUP``.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl


@triton.jit
def _online_softmax_step(qv, k, v, visible, m_i, l_i, acc, SCALE: tl.constexpr):
    """Fold one key/value tile into the running (max, sum, output) of an online softmax.
    Rows with nothing visible yet keep max -inf; ``m_safe`` avoids inf - inf there."""
    s = tl.where(visible, tl.dot(qv, tl.trans(k)) * SCALE, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    pr = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(pr, axis=1)
    acc = acc * alpha[:, None] + tl.dot(pr, v)
    return m_new, l_i, acc


@triton.jit
def tree_attention_kernel(q_ptr, kc_ptr, vc_ptr, kt_ptr, vt_ptr, prefix_ptr, bits_ptr, out_ptr,
                          Hq, Hkv, L, P, W, SCALE: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    bh = tl.program_id(0)
    b = bh // Hq
    h = bh % Hq
    hk = h // GROUP
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    dd = tl.arange(0, D)
    rmask = rows < L
    qv = tl.load(q_ptr + ((b * Hq + h) * L + rows[:, None]) * D + dd[None, :], mask=rmask[:, None],
                 other=0.0).to(tl.float32)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    plen = tl.load(prefix_ptr + b)
    for start in range(0, P, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        visible = rmask[:, None] & (cols[None, :] < plen)
        base = (b * Hkv + hk) * P + cols
        kp = kc_ptr + base[:, None] * D + dd[None, :]
        vp = vc_ptr + base[:, None] * D + dd[None, :]
        k = tl.load(kp, mask=(cols < P)[:, None], other=0.0).to(tl.float32)
        v = tl.load(vp, mask=(cols < P)[:, None], other=0.0).to(tl.float32)
        m_i, l_i, acc = _online_softmax_step(qv, k, v, visible, m_i, l_i, acc, SCALE)
    for start in range(0, L, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        words = tl.load(bits_ptr + (b * L + rows[:, None]) * W + cols[None, :] // 64,
                        mask=rmask[:, None] & (cols[None, :] < L), other=0)
        visible = ((words >> (cols[None, :] % 64).to(tl.int64)) & 1) != 0
        base = (b * Hkv + hk) * L + cols
        k = tl.load(kt_ptr + base[:, None] * D + dd[None, :], mask=(cols < L)[:, None], other=0.0).to(tl.float32)
        v = tl.load(vt_ptr + base[:, None] * D + dd[None, :], mask=(cols < L)[:, None], other=0.0).to(tl.float32)
        m_i, l_i, acc = _online_softmax_step(qv, k, v, visible, m_i, l_i, acc, SCALE)
    out = acc / l_i[:, None]  # nothing visible: 0/0 = NaN, as SDPA
    tl.store(out_ptr + ((b * Hq + h) * L + rows[:, None]) * D + dd[None, :], out.to(out_ptr.dtype.element_ty),
             mask=rmask[:, None])


def tree_attention(q, k_cache, v_cache, k_tree, v_tree, prefix_len, ancestor_bits, scale=None,
                   block_m: int = 16, block_n: int = 16):
    """Same contract as ``reference.tree_attention``; head dim a power of two >= 16."""
    B, Hq, L, d = q.shape
    Hkv, P = k_cache.shape[1], k_cache.shape[2]
    if Hq % Hkv or d & (d - 1) or d < 16:
        raise ValueError(f"need Hq % Hkv == 0 and a power-of-two head dim >= 16, got Hq={Hq}, Hkv={Hkv}, d={d}")
    out = torch.empty_like(q)
    W = ancestor_bits.shape[-1]
    grid = (B * Hq, triton.cdiv(L, block_m))
    tree_attention_kernel[grid](q.contiguous(), k_cache.contiguous(), v_cache.contiguous(), k_tree.contiguous(),
                                v_tree.contiguous(), prefix_len.contiguous(), ancestor_bits.contiguous(), out,
                                Hq, Hkv, L, P, W, SCALE=scale if scale is not None else 1.0 / math.sqrt(d),
                                GROUP=Hq // Hkv, D=d, BLOCK_M=block_m, BLOCK_N=block_n)
    return out
