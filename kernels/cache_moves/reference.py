"""Reference of the commit's in-place column moves: torch's gather and a write-back."""

from __future__ import annotations

from typing import Sequence

import torch


def source_columns(start: int, paths: Sequence[Sequence[int]]) -> torch.Tensor:
    """``[B, m]`` int64: column ``start + paths[b][j]``, and for ``j >= len(paths[b])``
    column ``start + j`` itself (an entry copied onto itself: unchanged)."""
    m = max((len(p) for p in paths), default=0)
    return start + torch.tensor([list(p) + list(range(len(p), m)) for p in paths], dtype=torch.int64)


def move_columns(layers: Sequence[tuple[torch.Tensor, torch.Tensor]], start: int,
                 paths: Sequence[Sequence[int]]) -> None:
    """For each ``(keys, values)`` pair (``[B, H, S, D]``, any device) and row ``b``: column
    ``start + j`` becomes a copy of column ``start + paths[b][j]``, ``j < len(paths[b])``,
    every source read before anything is written (so moves may overlap in any order). Other
    columns are left as they are.

    Example: start 3, paths [[0, 2, 5]]: column 3 keeps its entry, 5 -> 4, 8 -> 5.
    """
    src = source_columns(start, paths)
    m = src.shape[1]
    if m == 0:
        return
    idx = {}  # gather indices [B, H, m, D] by (device, H, D): the layers' tensors are alike
    for keys, values in layers:
        for x in (keys, values):
            key = (x.device, x.shape[1], x.shape[3])
            if key not in idx:
                idx[key] = src[:, None, :, None].to(x.device).expand(-1, x.shape[1], -1, x.shape[3])
            x[:, :, start:start + m] = x.gather(2, idx[key])
