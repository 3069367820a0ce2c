"""numba CPU path of the commit's column moves (same signature as ``reference``).

Why: a commit moves a few cached entries in each of the target's 30 layers. As torch ops
that is a gather and a write-back per tensor: 0.39 ms for 4 rows of 3 tree columns over
SmolLM2-135M's 60 tensors (one row 0.29), against 0.11 ms for one kernel call per tensor
on the 2-core Zen 5 AMD EPYC (bfloat16; ``python examples/measure_step_cuts.py --what
moves``, docs/results.md, "Twenty-ninth round"). The entries are copied as raw bytes, so
the result is the reference's bit for bit, whatever the dtype.

In place without a copy: column ``start + j`` is written with the entry of column
``start + paths[b][j] >= start + j``, in increasing ``j``, so every source is read before
anything writes it (the columns written so far all lie before it). A root-to-node path
in linear order has ``paths[b][j] >= j``; ``paths_apply`` checks it, ``tensor_applies``
the tensor, and the caller runs the reference where either fails.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
from numba import njit


@njit(cache=True)
def _move(x, start, src, lens):
    """``x [B, H, S, bytes]`` (a byte view): column ``start + j`` of row ``b`` from column
    ``src[b, j]``, ``j < lens[b]``, in increasing ``j``."""
    B, H, _, W = x.shape
    for b in range(B):
        for j in range(lens[b]):
            s = src[b, j]
            if s != start + j:
                for h in range(H):
                    for w in range(W):
                        x[b, h, start + j, w] = x[b, h, s, w]


def paths_apply(paths: Sequence[Sequence[int]]) -> bool:
    """Whether every ``paths[b][j] >= j`` (each source at or after its destination)."""
    return all(p >= j for path in paths for j, p in enumerate(path))


def tensor_applies(x: torch.Tensor, rows: int) -> bool:
    """Whether the kernel can move ``x``'s columns: a ``[rows, H, S, D]`` CPU tensor whose
    last axis is contiguous (so it reads as bytes without a copy), outside autograd."""
    return x.is_cpu and x.dim() == 4 and x.shape[0] == rows and x.stride(-1) == 1 and not x.requires_grad


def move_columns(layers: Sequence[tuple[torch.Tensor, torch.Tensor]], start: int,
                 paths: Sequence[Sequence[int]]) -> None:
    """``reference.move_columns`` (its preconditions: ``paths_apply``, and
    ``tensor_applies`` for every tensor)."""
    m = max((len(p) for p in paths), default=0)
    src = np.empty((len(paths), m), dtype=np.int64)
    lens = np.empty(len(paths), dtype=np.int64)
    for b, path in enumerate(paths):
        lens[b] = len(path)
        src[b, :len(path)] = [start + p for p in path]
    for keys, values in layers:
        _move(keys.view(torch.uint8).numpy(), start, src, lens)
        _move(values.view(torch.uint8).numpy(), start, src, lens)
