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
from numba import njit, prange

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


@njit(cache=True, inline="always")
def _first_max(p, law, scale, lo, hi):
    """``(t, r)``: the first token of ``lo..hi-1`` with the largest residual ``r`` (-1, -1.0
    when none is above -1)."""
    top, rtop = -1, -1.0
    for t in range(lo, hi):
        r = residual_at(p, law, scale, t)
        if r > rtop:
            top, rtop = t, r
    return top, rtop


@njit(cache=True, inline="always")
def _screen(p, law, scale, k0, c1, c2, c3, top, thr, blk_lo, blk_hi):
    """``(key, token)``: the best Gumbel key among the tokens of stream blocks
    ``blk_lo..blk_hi-1`` that pass the screen (``top`` always does), the first on ties;
    ``(-inf, -1)`` when none does."""
    V = p.shape[0]
    best, arg = -np.inf, -1
    for blk in range(blk_lo, blk_hi):
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
    return best, arg


@njit(cache=True, inline="always")
def _threshold(p, law, scale, k0, c1, c2, c3, top, buf):
    """The screen's bound from ``top``'s key: a token can win only if ``1 - u <= r * thr``."""
    bound = np.log(residual_at(p, law, scale, top)) - np.log(-np.log(stream_at(k0, c1, c2, c3, top, buf)))
    return np.exp(-bound) * (1.0 + _FILTER_SLACK)


@njit(cache=True)
def gumbel_max_stream(p, law, scale, k0, c1, c2, c3, buf, top):
    """``gumbel_max_uniform(r, u)`` for ``r = max(0, p - law) / scale`` (``law`` empty:
    plain ``p``) and ``u`` the stream's first ``V`` numbers, generated here block by
    block: the bound is the key of ``r``'s most likely token (``top``, or found here when
    ``top < 0``: the first maximum, as torch's argmax), and only tokens that pass the
    same filter get an exact key (first token on ties, as the reference)."""
    V = p.shape[0]
    if top < 0:
        top, _ = _first_max(p, law, scale, 0, V)
    thr = _threshold(p, law, scale, k0, c1, c2, c3, top, buf)
    best, arg = _screen(p, law, scale, k0, c1, c2, c3, top, thr, 0, (V + 3) // 4)
    return arg if arg >= 0 else top


#: at or below this many tokens a draw runs serially: on the 2-core Zen 5 AMD EPYC a split
#: draw of 1,024 tokens took 4.6 us against 4.3 serial, of 2,048 6.3 against 8.0, of 49,152
#: 77 against 145 (``gumbel_max_stream`` of a random law, warm)
SPLIT_MIN = 2048


@njit(cache=True, parallel=True)
def _chunked(p, law, scale, k0, c1, c2, c3, top, thr, chunks, best, arg):
    """``_screen`` (``top >= 0``) or ``_first_max`` (``top < 0``: ``best`` gets the
    residuals) over ``chunks`` contiguous ranges of stream blocks, one per thread."""
    V = p.shape[0]
    blocks = (V + 3) // 4
    per = (blocks + chunks - 1) // chunks
    for c in prange(chunks):
        lo, hi = c * per, min((c + 1) * per, blocks)
        if top < 0:
            arg[c], best[c] = _first_max(p, law, scale, min(4 * lo, V), min(4 * hi, V))
        else:
            best[c], arg[c] = _screen(p, law, scale, k0, c1, c2, c3, top, thr, lo, hi)


@njit(cache=True)
def gumbel_max_stream_split(p, law, scale, k0, c1, c2, c3, buf, top, chunks):
    """``gumbel_max_stream`` with the vocabulary split into ``chunks`` ranges of stream
    blocks screened on numba's threads (``SPLIT_MIN`` or fewer tokens, or one chunk: the
    serial function). The same token: each range keeps its first best key, and the ranges
    are merged in token order keeping the first of equal keys, which is the serial scan's
    winner; the most likely token is merged the same way."""
    V = p.shape[0]
    if chunks <= 1 or V <= SPLIT_MIN:
        return gumbel_max_stream(p, law, scale, k0, c1, c2, c3, buf, top)
    best = np.empty(chunks)
    arg = np.empty(chunks, dtype=np.int64)
    if top < 0:
        _chunked(p, law, scale, k0, c1, c2, c3, top, 0.0, chunks, best, arg)
        rtop = -1.0
        for c in range(chunks):
            if best[c] > rtop:
                top, rtop = arg[c], best[c]
    thr = _threshold(p, law, scale, k0, c1, c2, c3, top, buf)
    _chunked(p, law, scale, k0, c1, c2, c3, top, thr, chunks, best, arg)
    key, win = -np.inf, -1
    for c in range(chunks):
        if best[c] > key:
            key, win = best[c], arg[c]
    return win if win >= 0 else top
