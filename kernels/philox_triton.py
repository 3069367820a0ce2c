"""Triton Philox4x64-10 that reproduces ``rheoplan.rng.Streams.uniform`` bit for bit.

The counter-based streams are a pure function of ``(seed, step, tree, node, purpose)``
(``rheoplan.rng.philox_counter``), so the device can generate the very numbers numpy
draws on the host: ``tl.philox`` on uint64 counters with key ``(seed, 0)`` is numpy's
Philox4x64-10; numpy bumps word 0 of the counter before each block of 4 numbers (it
starts at 0, so block ``k`` uses ``k + 1``), and a double is ``(word >> 11) * 2**-53``,
clipped like ``Streams.uniform``. Tested against numpy in ``tests/kernels/test_philox.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_TINY = tl.constexpr(2.2250738585072014e-308)  # np.finfo(np.float64).tiny
_ONE_MINUS = tl.constexpr(1.0 - 2.0 ** -53)


@triton.jit
def streams_uniform_kernel(out_ptr, tree_ptr, node_ptr, seed, step, purpose, n, BLOCK: tl.constexpr):
    """Row r of ``out [R, n]`` = ``Streams(seed).uniform(step, tree[r], node[r], purpose, n)``."""
    r = tl.program_id(0)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    tree = tl.load(tree_ptr + r).to(tl.uint64, bitcast=True)
    node = tl.load(node_ptr + r)
    zero = tl.zeros([BLOCK], dtype=tl.uint64)
    c0 = (i // 4 + 1).to(tl.uint64)
    c1 = zero + tl.full((), step, tl.int64).to(tl.uint64, bitcast=True)
    c2 = zero + tree
    c3 = zero + (node * 8 + purpose).to(tl.uint64, bitcast=True)
    w0, w1, w2, w3 = tl.philox(seed, c0, c1, c2, c3, 10)
    k = i % 4
    w = tl.where(k == 0, w0, tl.where(k == 1, w1, tl.where(k == 2, w2, w3)))
    u = (w >> 11).to(tl.float64) * (1.0 / 9007199254740992.0)
    u = tl.minimum(tl.maximum(u, _TINY), _ONE_MINUS)
    tl.store(out_ptr + r.to(tl.int64) * n + i, u, mask=i < n)


def streams_uniform(seed: int, step: int, trees: torch.Tensor, nodes: torch.Tensor, purpose: int,
                    n: int, block: int = 1024) -> torch.Tensor:
    """Uniforms ``[R, n]`` float64 on ``nodes``' device (``purpose`` is the counter's purpose
    word, ``Streams.purpose_key``)."""
    R = nodes.shape[0]
    out = torch.empty(R, n, dtype=torch.float64, device=nodes.device)
    if R == 0 or n == 0:
        return out
    BLOCK = min(block, triton.next_power_of_2(n))
    streams_uniform_kernel[(R, triton.cdiv(n, BLOCK))](
        out, trees.to(torch.int64).contiguous(), nodes.to(torch.int64).contiguous(), int(seed), int(step),
        int(purpose), n, BLOCK=BLOCK)
    return out
