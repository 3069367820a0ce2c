"""Triton draws of ``rheoplan.rng.Streams`` inside a kernel (Philox4x64-10, as numpy's).

A draw of ``Streams`` is ``numpy.random.Philox(key=seed, counter=[0, step, tree,
node * 8 + purpose])``: number ``i`` of the stream is word ``i % 4`` of the Philox block
with counter word 0 equal to ``i // 4 + 1`` (numpy bumps the counter before each block of
four), turned into a float64 by ``(x >> 11) * 2**-53`` and clipped like ``Streams.uniform``.
``tl.philox`` on uint64 counters is the same Philox4x64-10 (same multipliers and Weyl key
increments; the key's high word is 0 because ``seed < 2**63``), so the raw words and the
uniforms are bit-identical to numpy's. The Gumbel transform ``-log(-log(u))`` uses the
device's float64 ``log`` (libdevice on CUDA, numpy under the interpreter), which may differ
from torch's CPU ``log`` in the last bit; that matters only at exact near-ties of two
Gumbel keys.

``streams_uniform`` / ``streams_gumbel`` launch it for one stream (parity tests, and a
device-side replacement for ``Streams.gumbel``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def philox_uniform(seed, step, tree, word3, idx):
    """Uniforms in (0, 1), float64, of stream (seed, [0, step, tree, word3]) at indices ``idx``
    (an int tensor); equal bit for bit to ``Streams.uniform``."""
    c0 = (idx // 4 + 1).to(tl.uint64)
    zero = tl.zeros_like(c0)
    c1 = zero + step.to(tl.uint64)
    c2 = zero + tree.to(tl.uint64)
    c3 = zero + word3.to(tl.uint64)
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
def _streams_kernel(out_ptr, seed, step, tree, word3, n, GUMBEL: tl.constexpr, BLOCK: tl.constexpr):
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    if GUMBEL:
        v = philox_gumbel(tl.full((), seed, tl.int64), tl.full((), step, tl.int64), tl.full((), tree, tl.int64),
                          tl.full((), word3, tl.int64), idx)
    else:
        v = philox_uniform(tl.full((), seed, tl.int64), tl.full((), step, tl.int64), tl.full((), tree, tl.int64),
                           tl.full((), word3, tl.int64), idx)
    tl.store(out_ptr + idx, v, mask=idx < n)


def _launch(seed: int, step: int, tree: int, node: int, purpose: int, n: int, device, gumbel: bool):
    if not 0 <= seed < 2 ** 63:
        raise ValueError(f"seed={seed} is out of range: allowed [0, 2**63)")
    for name, v in (("step", step), ("tree", tree), ("node", node), ("purpose", purpose), ("n", n)):
        if v < 0:
            raise ValueError(f"{name}={v}: allowed >= 0")
    out = torch.empty(n, dtype=torch.float64, device=device)
    if n:
        block = min(256, triton.next_power_of_2(n))
        _streams_kernel[(triton.cdiv(n, block),)](out, seed, step, tree, node * 8 + purpose, n,
                                                  GUMBEL=gumbel, BLOCK=block)
    return out


def streams_uniform(seed: int, step: int, tree: int, node: int, purpose: int, n: int, device="cuda"):
    """``Streams(seed).uniform(step, tree, node, purpose, n)`` computed on ``device``."""
    return _launch(seed, step, tree, node, int(purpose), n, device, False)


def streams_gumbel(seed: int, step: int, tree: int, node: int, purpose: int, n: int, device="cuda"):
    """``Streams(seed).gumbel(step, tree, node, purpose, n)`` computed on ``device``."""
    return _launch(seed, step, tree, node, int(purpose), n, device, True)
