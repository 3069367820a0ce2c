"""Moving a step's accepted tree entries to the front of the KV cache, in place.

After a verify forward, every layer's keys and values hold the tree's entries after the
committed ones; a commit moves the accepted path's entries (tree offsets ``paths[b][j]``)
to offsets ``j`` and drops the rest (``rheoplan.models.row_cache.RowCache.commit_paths``,
``rheoplan.models._hf_common.commit_cache``). ``reference`` does it with torch ops (a
gather into a copy and a write-back: two operator calls per tensor, 60 tensors for
SmolLM2-135M); ``cpu`` with one numba call per tensor. Same signature, same bits: the
entries are copied, not computed.

``move_columns`` picks ``cpu`` where its precondition holds (CPU tensors whose last axis is
contiguous; every moved entry read from at or after the column it is written to, which a
root-to-node path in linear order always is) and ``reference`` elsewhere.
"""

from __future__ import annotations

from typing import Sequence

import torch

from rheoplan.kernels.cache_moves import cpu, reference


def move_columns(layers: Sequence[tuple[torch.Tensor, torch.Tensor]], start: int,
                 paths: Sequence[Sequence[int]]) -> None:
    """``reference.move_columns``, by the numba kernel for every layer it applies to
    (``cpu.paths_apply``, ``cpu.tensor_applies``), by torch for the others."""
    if not cpu.paths_apply(paths):
        reference.move_columns(layers, start, paths)
        return
    rows = len(paths)
    fast, slow = [], []
    for keys, values in layers:
        ok = cpu.tensor_applies(keys, rows) and cpu.tensor_applies(values, rows)
        (fast if ok else slow).append((keys, values))
    if fast:
        cpu.move_columns(fast, start, paths)
    if slow:
        reference.move_columns(slow, start, paths)
