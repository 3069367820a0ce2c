"""Batched noise of the counter-based streams, by backend: row r of the result is
``streams.uniform(step, trees[r], nodes[r], purpose, n)`` (or ``.gumbel``), whichever
implementation makes it:

* ``reference``: ``Streams`` itself, one numpy Generator per row;
* ``numba``: ``rheoplan.kernels.philox`` (numba, CPU), many rows per call;
* ``triton``: ``rheoplan.kernels.philox_triton`` on the rows' device: no host transfer.

All three give the same bits (tested); the Gumbel transform is ``rheoplan.rng.gumbel_from_uniform``.
"""

from __future__ import annotations

import numpy as np
import torch

from rheoplan.rng import Purpose, Streams, gumbel_from_uniform, philox_counter


def uniform_rows(streams: Streams, step: int, trees: torch.Tensor, nodes: torch.Tensor, purpose: Purpose,
                 n: int, backend: str) -> torch.Tensor:
    """Uniforms ``[R, n]`` float64 on ``nodes``' device."""
    key = streams.purpose_key(purpose)  # mutation (c) collapses the purposes here
    R = int(nodes.shape[0])
    if backend == "triton":
        from rheoplan.kernels.philox_triton import streams_uniform

        return streams_uniform(streams.seed, step, trees, nodes, key, n)
    if backend == "numba":
        from rheoplan.kernels.philox import streams_uniform

        t = trees.cpu().numpy().astype(np.uint64)
        v = nodes.cpu().numpy().astype(np.uint64)
        ctr = np.empty((R, 4), dtype=np.uint64)
        for w, word in enumerate(philox_counter(step, t, v, key)):
            ctr[:, w] = word
        out = np.full((R, n), 0.5)
        streams_uniform(streams.seed, ctr, np.full(R, n, dtype=np.int64), out)
        return torch.from_numpy(out).to(nodes.device)
    if backend == "reference":
        rows = [streams.uniform(step, int(b), int(v), Purpose(purpose), n) for b, v in
                zip(trees.tolist(), nodes.tolist())]
        out = torch.stack(rows) if rows else torch.empty(0, n, dtype=torch.float64)
        return out.to(nodes.device)
    raise ValueError(f"backend={backend!r} is not one of ('reference', 'numba', 'triton')")


def gumbel_rows(streams: Streams, step: int, trees: torch.Tensor, nodes: torch.Tensor, purpose: Purpose,
                n: int, backend: str) -> torch.Tensor:
    """Standard Gumbel noise ``[R, n]`` float64: ``gumbel_from_uniform(uniform_rows(...))``."""
    return gumbel_from_uniform(uniform_rows(streams, step, trees, nodes, purpose, n, backend))
