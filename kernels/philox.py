"""numba Philox4x64-10 that reproduces numpy's ``Philox`` bit for bit.

``rheoplan.rng.Streams`` builds one ``numpy.random.Philox(key=seed, counter=philox_counter(step,
tree, node, purpose))`` per draw; constructing a Generator costs ~25 us, which is too
much for ~70 expanded nodes per step. ``streams_uniform`` computes the same uniforms
for many counters in one numba call (the generator is counter-based, so nothing but
the counter and key is needed).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

_M0 = np.uint64(0xD2E7470EE14C6C93)
_M1 = np.uint64(0xCA5A826395121157)
_W0 = np.uint64(0x9E3779B97F4A7C15)
_W1 = np.uint64(0xBB67AE8584CAA73B)
_TINY = np.finfo(np.float64).tiny
_ONE_MINUS = 1.0 - 2.0 ** -53


@intrinsic
def _mulhilo(typingctx, a, b):
    """(hi, lo) 64-bit halves of the 128-bit product ``a * b`` (uint64): one native
    multiply (LLVM ``i128``), as numpy's C Philox does; four 32-bit limb products made
    this generator ~3x slower than numpy's."""
    sig = types.UniTuple(types.uint64, 2)(types.uint64, types.uint64)

    def codegen(context, builder, signature, args):
        i64, i128 = ir.IntType(64), ir.IntType(128)
        prod = builder.mul(builder.zext(args[0], i128), builder.zext(args[1], i128))
        hi = builder.trunc(builder.lshr(prod, ir.Constant(i128, 64)), i64)
        lo = builder.trunc(prod, i64)
        return context.make_tuple(builder, signature.return_type, (hi, lo))

    return sig, codegen


@njit(cache=True, inline="always")
def philox_words(c0, c1, c2, c3, k0, k1):
    """The 4 output words of one Philox4x64-10 block (counter ``c0..c3``, key ``k0, k1``),
    as a tuple: kept in registers, where writing them to an array made a long draw's
    generator 1.5x slower (0.42 against 0.28 ms per 49152 numbers on the 2-core CPU)."""
    for r in range(10):
        if r > 0:
            k0 = k0 + _W0
            k1 = k1 + _W1
        hi0, lo0 = _mulhilo(_M0, c0)
        hi1, lo1 = _mulhilo(_M1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


@njit(cache=True)
def _philox_block(c0, c1, c2, c3, k0, k1, out):
    out[0], out[1], out[2], out[3] = philox_words(c0, c1, c2, c3, k0, k1)


@njit(cache=True)
def unit_double(word):
    """A uniform in (0, 1) from one 64-bit word, as ``Streams.uniform`` makes it: numpy's
    53-bit double, clipped away from 0 and 1."""
    u = np.float64(word >> np.uint64(11)) * (1.0 / 9007199254740992.0)
    return min(max(u, _TINY), _ONE_MINUS)


@njit(cache=True)
def streams_uniform(seed, counters, counts, out):
    """Uniforms of ``Streams.uniform`` for many counters at once.

    ``counters [R, 4]`` uint64 rows made by ``rheoplan.rng.philox_counter``; row ``r`` writes
    ``counts[r]`` values into ``out[r, :counts[r]]`` (float64, clipped like ``Streams``).
    ``seed`` must be < 2**63 (the key's high word is then 0).
    """
    k0 = np.uint64(seed)
    k1 = np.uint64(0)
    one = np.uint64(1)
    words = (one, one, one, one)
    for r in range(counters.shape[0]):
        c0, c1, c2, c3 = counters[r, 0], counters[r, 1], counters[r, 2], counters[r, 3]
        for i in range(counts[r]):
            if i % 4 == 0:  # numpy bumps the counter before each 4-word block (with carry)
                c0 = c0 + one
                if c0 == 0:
                    c1 = c1 + one
                    if c1 == 0:
                        c2 = c2 + one
                        if c2 == 0:
                            c3 = c3 + one
                words = philox_words(c0, c1, c2, c3, k0, k1)
            out[r, i] = unit_double(words[i % 4])
