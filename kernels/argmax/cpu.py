"""numba CPU path of the rows' first maximum (same contract as ``reference``).

Why: ``torch.max(x, dim=-1)`` with indices is a slow reduction on the CPU: 102 us for
8 rows x 49,152 float32 logits on the 2-core Zen 5 AMD EPYC, against 13 us for ``amax``
(values only). A greedy 4-row batch reads ~8 such rows per step and spent ~0.33 ms a
step in it (docs/results.md, "Thirtieth round"). Here the maximum comes from ``amax`` and
the index from a scan for the first entry equal to it, 128 entries at a time (a count of
equal entries per block, which the compiler vectorises, then the one block that holds
it entry by entry): 20 us for those 8 rows, 8 us for one row against 30.

The first entry ``== top`` is the first maximal entry, the index ``torch.max`` and
``argmax`` return (``-0.0 == 0.0``: the two zeros tie, as they do for them). A row with a
NaN gets index -1 (a NaN equals nothing); ``first_max`` in the package runs the reference
wherever a row's maximum is not finite (broken logits: the caller's error path).
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit

#: entries per block of the scan: a vector count per block, then one block entry by entry
BLOCK = 128


@njit(cache=True)
def _first_equal(x, top, out):
    """``out[r]``: the first ``j`` with ``x[r, j] == top[r]`` (-1 where none)."""
    R, V = x.shape
    for r in range(R):
        t = top[r]
        out[r] = -1
        i = 0
        while i + BLOCK <= V:
            hits = 0
            for j in range(i, i + BLOCK):
                hits += x[r, j] == t
            if hits:
                break
            i += BLOCK
        for j in range(i, V):
            if x[r, j] == t:
                out[r] = j
                break


def applies(x: torch.Tensor) -> bool:
    """Whether the kernel reads ``x`` as it is: a contiguous CPU float32 tensor with at
    least one entry per row, outside autograd."""
    return (x.is_cpu and x.dtype == torch.float32 and x.dim() >= 1 and x.shape[-1] > 0 and x.is_contiguous()
            and not x.requires_grad)


def first_max(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``reference.first_max`` for rows whose maximum is finite (``applies(x)`` must hold);
    a row with a NaN gets index -1."""
    top = x.amax(dim=-1)
    V = x.shape[-1]
    index = np.empty(top.numel(), dtype=np.int64)
    _first_equal(x.reshape(-1, V).numpy(), top.reshape(-1).numpy(), index)
    return top, torch.from_numpy(index).reshape(top.shape)
