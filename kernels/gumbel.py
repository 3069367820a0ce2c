"""Gumbel-max draws read straight from a counter-based stream (numba, CPU).

``gumbel_max_stream`` is ``rheoplan.verify.gumbel_max_uniform`` (its reference: the
screened Gumbel-max, the same winner as ``argmax(log p + gumbel_from_uniform(u))``) for
one row whose uniforms ``u`` are the first numbers of a ``Streams`` stream, made block by
block as the screen reads them and never stored. Every numba draw of the project goes
through it: the walk's draws at a node (``kernels.verify.cpu``), a batch's draft-free rows
(``kernels.verify.cpu.root_draws``) and the planner's sampled slots
(``kernels.slot_expansion.cpu.tail_draws``).

Parity: numba's ``log`` is glibc's, torch's is SLEEF's; they differ in the last bit for a
few inputs in a thousand, which changes a winner only when two keys agree to ~1e-16 (not
observed in the tests; such draws have probability ~1e-15). Only the winner leaves these
kernels, never a key.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from rheoplan.kernels.philox import _philox_block, philox_words, unit_double
from rheoplan.verify import FILTER_SLACK as _FILTER_SLACK


@njit(cache=True)
def stream_at(k0, c1, c2, c3, i, buf):
    """Number ``i`` of the stream with counter ``[0, c1, c2, c3]`` (``Streams.uniform``):
    numpy's Philox bumps word 0 once before each block of 4, so number ``i`` is word
    ``i % 4`` of block ``i // 4 + 1``."""
    _philox_block(np.uint64(i // 4 + 1), c1, c2, c3, k0, np.uint64(0), buf)
    return unit_double(buf[i % 4])


#: the ``law`` of a draw from ``p`` itself (no residual): ``residual_at`` reads ``p`` only
NO_LAW = np.zeros(0)


@njit(cache=True, inline="always")
def residual_at(p, law, scale, t):
    """``max(0, p - law) / scale`` at token ``t``, or ``p[t]`` itself when ``law`` is
    empty (a draw from ``p``: the same value, without a subtraction and a division per
    token)."""
    if law.shape[0] == 0:
        return p[t]
    r = p[t] - law[t]
    return (r if r > 0.0 else 0.0) / scale


@njit(cache=True)
def gumbel_max_stream(p, law, scale, k0, c1, c2, c3, buf, top):
    """``gumbel_max_uniform(r, u)`` for ``r = max(0, p - law) / scale`` (``law`` empty:
    plain ``p``) and ``u`` the stream's first ``V`` numbers, generated here block by
    block: the bound is the key of ``r``'s most likely token (``top``, or found here when
    ``top < 0``: the first maximum, as torch's argmax), and only tokens that pass the
    same filter get an exact key (first token on ties, as the reference)."""
    V = p.shape[0]
    if top < 0:
        rtop = -1.0
        for t in range(V):
            r = residual_at(p, law, scale, t)
            if r > rtop:
                top, rtop = t, r
    bound = np.log(residual_at(p, law, scale, top)) - np.log(-np.log(stream_at(k0, c1, c2, c3, top, buf)))
    thr = np.exp(-bound) * (1.0 + _FILTER_SLACK)
    best, arg = -np.inf, top
    for blk in range((V + 3) // 4):
        words = philox_words(np.uint64(blk + 1), c1, c2, c3, k0, np.uint64(0))
        for w in range(4):
            t = blk * 4 + w
            if t >= V:
                break
            u = unit_double(words[w])
            r = residual_at(p, law, scale, t)
            if t == top or (1.0 - u) <= r * thr:
                key = np.log(r) - np.log(-np.log(u))
                if key > best:  # tokens in increasing order: the first wins a tie
                    best, arg = key, t
    return arg
