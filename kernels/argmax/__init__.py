"""The first maximum of every row of logits: a greedy pick's token and its check.

``first_max(x) -> (top, index)`` is ``torch.max(x, dim=-1)``: the greedy token of each row
(``rheoplan.distributions.greedy_tokens``) and the row maxima its broken-logits check
reads. ``reference`` is that torch call; ``cpu`` takes the maximum from ``amax`` and finds
its first entry with a numba scan, about 5x faster on the CPU. Same values, same indices.

``first_max`` below picks ``cpu`` where it applies (a contiguous CPU float32 tensor) and
every row's maximum is finite, and ``reference`` elsewhere: a row with a NaN or an
infinity is broken, and the reference then gives the caller torch's answer for it.
"""

from __future__ import annotations

import torch

from rheoplan.kernels.argmax import cpu, reference


def first_max(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``reference.first_max(x)``, by the numba scan where it applies.

    Example:
        >>> top, i = first_max(torch.tensor([[0., 2., 2.], [5., 0., 1.]]))
        >>> top.tolist(), i.tolist()
        ([2.0, 5.0], [1, 0])
    """
    if not cpu.applies(x):
        return reference.first_max(x)
    top, index = cpu.first_max(x)
    if not bool(torch.isfinite(top).all()):
        return reference.first_max(x)
    return top, index
