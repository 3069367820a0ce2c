"""Batched uniforms of the counter-based streams, by backend: row r of the result is
``Streams(seed).uniform(step, trees[r], nodes[r], purpose, n)`` with ``purpose`` the
counter word (``Streams.purpose_key``):

* ``numba_uniform``: ``rheoplan.kernels.philox`` (numba, CPU), many rows per call;
* ``rheoplan.kernels.philox_triton.streams_uniform``: the same numbers on the device.

``uniform_fn(backend)`` picks one; the kernel passes hand it to the sampler's batch
interface (``GumbelSampler.gumbel_rows``). ``uniform_rows`` / ``gumbel_rows`` take a
``Streams`` and a backend ('reference' loops over ``Streams``), for tests and benchmarks.
All give the same bits (``tests/kernels/test_philox.py``).
"""

from __future__ import annotations

import numpy as np
import torch

from rheoplan.kernels.philox import streams_uniform as _numba_streams_uniform
from rheoplan.rng import Purpose, Streams, gumbel_from_uniform, philox_counter


#: ``counter_rows`` builds up to this many rows with Python ints
_FEW_ROWS = 8


def counter_rows(step, trees, nodes, purpose: int) -> np.ndarray:
    """The ``[R, 4]`` uint64 Philox counters of rows ``(step, trees[r], nodes[r])``
    (``rheoplan.rng.philox_counter`` elementwise; ``step`` one int or one per row), as the
    numba generator and draws take them.

    A few rows (a step's frontier) are built as Python ints, one ``philox_counter`` call
    per row: ~10 numpy operations on tiny arrays cost ~40 us in a decode's plan, where the
    interpreter comes back to them cold after each forward. Wrapped to 64 bits as numpy
    wraps (int64, then to uint64), so both ways give the same words."""
    if len(nodes) <= _FEW_ROWS:
        steps = [int(step)] * len(nodes) if np.isscalar(step) else np.asarray(step).tolist()
        rows = [philox_counter(s, t, v, purpose)
                for s, t, v in zip(steps, np.asarray(trees).tolist(), np.asarray(nodes).tolist())]
        return np.array(rows, dtype=np.int64).reshape(len(nodes), 4).astype(np.uint64)
    v = np.asarray(nodes).astype(np.uint64)
    if not np.isscalar(step):
        step = np.asarray(step).astype(np.uint64)
    ctr = np.empty((v.shape[0], 4), dtype=np.uint64)
    for w, word in enumerate(philox_counter(step, np.asarray(trees).astype(np.uint64), v, purpose)):
        ctr[:, w] = word
    return ctr


def numba_uniform(seed: int, step: int | torch.Tensor, trees: torch.Tensor, nodes: torch.Tensor, purpose: int,
                  n: int) -> torch.Tensor:
    """Uniforms ``[R, n]`` float64 (numba Philox on the CPU), returned on ``nodes``' device.
    ``step``: one step for every row, or ``[R]`` (rows of a batch at different steps)."""
    R = int(nodes.shape[0])
    if isinstance(step, torch.Tensor):
        step = step.cpu().numpy()
    ctr = counter_rows(step, trees.cpu().numpy(), nodes.cpu().numpy(), purpose)
    out = np.full((R, n), 0.5)
    _numba_streams_uniform(seed, ctr, np.full(R, n, dtype=np.int64), out)
    return torch.from_numpy(out).to(nodes.device)


def uniform_fn(backend: str):
    """The batched ``Streams.uniform`` of ``backend`` ('numba' or 'triton')."""
    if backend == "numba":
        return numba_uniform
    if backend == "triton":
        from rheoplan.kernels.philox_triton import streams_uniform

        return streams_uniform
    raise ValueError(f"backend={backend!r}: a batched generator exists for 'numba' and 'triton'")


def uniform_rows(streams: Streams, step: int, trees: torch.Tensor, nodes: torch.Tensor, purpose: Purpose,
                 n: int, backend: str) -> torch.Tensor:
    """Uniforms ``[R, n]`` float64 on ``nodes``' device, from ``backend``'s generator."""
    if backend == "reference":
        rows = [streams.uniform(step, int(b), int(v), purpose, n) for b, v in zip(trees.tolist(), nodes.tolist())]
        out = torch.stack(rows) if rows else torch.empty(0, n, dtype=torch.float64)
        return out.to(nodes.device)
    return uniform_fn(backend)(streams.seed, step, trees, nodes, streams.purpose_key(purpose), n)


def gumbel_rows(streams: Streams, step: int, trees: torch.Tensor, nodes: torch.Tensor, purpose: Purpose,
                n: int, backend: str) -> torch.Tensor:
    """Standard Gumbel noise ``[R, n]`` float64: ``gumbel_from_uniform(uniform_rows(...))``."""
    return gumbel_from_uniform(uniform_rows(streams, step, trees, nodes, purpose, n, backend))
