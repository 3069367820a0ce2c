"""Triton Philox4x64-10 that reproduces ``rheoplan.rng.Streams`` bit for bit, in a kernel.

The counter-based streams are a pure function of ``(seed, step, tree, node, purpose)``
(``rheoplan.rng.philox_counter``), so the device can generate the very numbers numpy
draws on the host: ``tl.philox`` on uint64 counters with key ``(seed, 0)`` is numpy's
Philox4x64-10 (same multipliers and Weyl key increments; the key's high word is 0 because
``seed < 2**63``); numpy bumps word 0 of the counter before each block of 4 numbers (it
starts at 0, so number ``i`` is word ``i % 4`` of the block with word 0 equal to
``i // 4 + 1``), and a double is ``(word >> 11) * 2**-53``, clipped like
``Streams.uniform``. The Gumbel transform ``-log(-log(u))`` uses the device's float64
``log`` (libdevice on CUDA, numpy under the interpreter); it may differ from torch's CPU
``log`` in the last bit, which matters only at exact near-ties of two Gumbel keys.

``philox_uniform`` / ``philox_gumbel`` are the ``@triton.jit`` helpers a kernel calls (the
verify walk draws its noise with them); ``streams_uniform`` / ``streams_gumbel`` launch them
for many streams at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def philox_uniform(seed, step, tree, word3, idx):
    """Uniforms in (0, 1), float64, of stream ``(seed, [0, step, tree, word3])`` at indices
    ``idx`` (an int tensor); ``word3 = node * 8 + purpose``. Equal bit for bit to
    ``Streams.uniform``. The result has ``idx``'s shape, at least ``[1]``."""
    c0 = (idx // 4 + 1).to(tl.uint64)
    zero = tl.zeros_like(c0)
    c1 = zero + step.to(tl.uint64, bitcast=True)
    c2 = zero + tree.to(tl.uint64, bitcast=True)
    c3 = zero + word3.to(tl.uint64, bitcast=True)
    r0, r1, r2, r3 = tl.philox(seed.to(tl.int64), c0, c1, c2, c3, 10)
    w = idx % 4
    x = tl.where(w == 0, r0, tl.where(w == 1, r1, tl.where(w == 2, r2, r3)))
    u = (x >> 11).to(tl.float64) * (1.0 / 9007199254740992.0)
    # clipped to [finfo(float64).tiny, 1 - 2**-53], as Streams.uniform
    return tl.minimum(tl.maximum(u, 2.2250738585072014e-308), 1.0 - 1.1102230246251565e-16)


@triton.jit
def philox_gumbel(seed, step, tree, word3, idx):
    """Standard Gumbel variables ``-log(-log(u))``, float64, of the same stream."""
    u = philox_uniform(seed, step, tree, word3, idx)
    return -tl.log(-tl.log(u))


@triton.jit
def streams_uniform_kernel(out_ptr, tree_ptr, node_ptr, seed, step, purpose, n, GUMBEL: tl.constexpr,
                           BLOCK: tl.constexpr):
    """Row r of ``out [R, n]`` = ``Streams(seed).uniform(step, tree[r], node[r], purpose, n)``
    (``.gumbel`` when GUMBEL)."""
    r = tl.program_id(0)
    i = (tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    tree = tl.load(tree_ptr + r)
    w3 = tl.load(node_ptr + r) * 8 + purpose
    seed_ = tl.full((), seed, tl.int64)  # a scalar argument equal to 1 arrives as a constexpr
    step_ = tl.full((), step, tl.int64)
    if GUMBEL:
        v = philox_gumbel(seed_, step_, tree, w3, i)
    else:
        v = philox_uniform(seed_, step_, tree, w3, i)
    tl.store(out_ptr + r.to(tl.int64) * n + i, v, mask=i < n)


def _streams(seed, step, trees, nodes, purpose, n, block, gumbel):
    if not 0 <= int(seed) < 2 ** 63:
        raise ValueError(f"seed={seed} is out of range: allowed [0, 2**63)")
    if int(step) < 0 or int(n) < 0:
        raise ValueError(f"step={step}, n={n}: allowed >= 0")
    if trees.shape != nodes.shape or nodes.dim() != 1:
        raise ValueError(f"trees and nodes must be [R] alike, got {tuple(trees.shape)}, {tuple(nodes.shape)}")
    R = nodes.shape[0]
    out = torch.empty(R, n, dtype=torch.float64, device=nodes.device)
    if R == 0 or n == 0:
        return out
    BLOCK = min(block, triton.next_power_of_2(n))
    streams_uniform_kernel[(R, triton.cdiv(n, BLOCK))](
        out, trees.to(device=nodes.device, dtype=torch.int64).contiguous(), nodes.to(torch.int64).contiguous(),
        int(seed), int(step), int(purpose), n, GUMBEL=gumbel, BLOCK=BLOCK)
    return out


def streams_uniform(seed: int, step: int, trees: torch.Tensor, nodes: torch.Tensor, purpose: int,
                    n: int, block: int = 256) -> torch.Tensor:
    """Uniforms ``[R, n]`` float64 on ``nodes``' device (``purpose`` is the counter's purpose
    word, ``Streams.purpose_key``)."""
    return _streams(seed, step, trees, nodes, purpose, n, block, False)


def streams_gumbel(seed: int, step: int, trees: torch.Tensor, nodes: torch.Tensor, purpose: int,
                   n: int, block: int = 256) -> torch.Tensor:
    """Gumbel variables ``[R, n]`` float64: ``Streams(seed).gumbel(step, trees[r], nodes[r], purpose, n)``."""
    return _streams(seed, step, trees, nodes, purpose, n, block, True)
