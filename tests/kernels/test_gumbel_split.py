"""``kernels/gumbel.py``: the draw split over threads (``gumbel_max_stream_split``) returns
the serial draw's token for every split, with and without a residual, with and without a
given most likely token, and no range of the stream dropped; the walk's node draw, which
uses it, still emits the reference walk's tokens (``tests/kernels/verify``). (Which token
the split takes as the most likely one cannot show in its output: the screen is exact
for any bound, so there is no test of that merge's tie rule.)"""

from __future__ import annotations

import numpy as np
import pytest

from rheoplan.kernels.gumbel import NO_LAW, SPLIT_MIN, gumbel_max_stream, gumbel_max_stream_split


def _law(V: int, seed: int, peaked: bool) -> np.ndarray:
    g = np.random.default_rng(seed)
    x = g.standard_normal(V) * (6.0 if peaked else 1.0)
    p = np.exp(x - x.max())
    return p / p.sum()


@pytest.mark.parametrize("V", [SPLIT_MIN + 1, 49152, 50257])
@pytest.mark.parametrize("chunks", [2, 3, 7])
@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("residual", [False, True])
def test_split_draw_is_the_serial_draw(V, chunks, seed, residual):
    p = _law(V, seed, peaked=seed % 2 == 0)
    law, scale = NO_LAW, 1.0
    if residual:  # a proposal law on a few tokens, as a rejected node's residual
        law = np.zeros(V)
        toks = np.argsort(-p)[:5]
        law[toks] = p[toks] * 1.5
        r = np.maximum(p - law, 0.0)
        scale = r.sum()
    buf = np.empty(4, dtype=np.uint64)
    k0, c = np.uint64(1000 + seed), [np.uint64(seed), np.uint64(7), np.uint64(3)]
    for top in (-1, int(np.argmax(np.maximum(p - law, 0.0) if residual else p))):
        want = gumbel_max_stream(p, law, scale, k0, c[0], c[1], c[2], buf, top)
        got = gumbel_max_stream_split(p, law, scale, k0, c[0], c[1], c[2], buf, top, chunks)
        assert got == want


@pytest.mark.parametrize("V", [SPLIT_MIN + 1, 49152 + 3])
@pytest.mark.parametrize("chunks", [2, 3, 7])
@pytest.mark.parametrize("at", ["first", "last", "chunk_edge"])
def test_every_token_is_screened(V, chunks, at):
    """Nearly all the mass on one token at the vocabulary's ends or where two chunks meet:
    both draws return it, so no split drops or doubles a range of the stream."""
    blocks = (V + 3) // 4
    edge = 4 * ((blocks + chunks - 1) // chunks)  # first token of the second chunk
    t = {"first": 0, "last": V - 1, "chunk_edge": min(edge, V - 1)}[at]
    p = np.full(V, 1e-9)
    p[t] = 1.0
    p /= p.sum()
    buf = np.empty(4, dtype=np.uint64)
    for seed in range(3):
        args = (p, NO_LAW, 1.0, np.uint64(seed), np.uint64(4), np.uint64(5), np.uint64(6), buf)
        assert gumbel_max_stream(*args, -1) == t
        assert gumbel_max_stream_split(*args, -1, chunks) == t
        assert gumbel_max_stream_split(*args, t, chunks) == t
