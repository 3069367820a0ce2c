"""Reference of the rows' first maximum: torch's ``max`` over the last axis."""

from __future__ import annotations

import torch


def first_max(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(top, index)`` of every row of ``x [..., V]``: the row's maximum and the first
    index holding it (``torch.max(x, dim=-1)``; a row with a NaN has NaN as its maximum).

    Example:
        >>> top, i = first_max(torch.tensor([[0., 2., 2.], [5., 0., 1.]]))
        >>> top.tolist(), i.tolist()
        ([2.0, 5.0], [1, 0])
    """
    return x.max(dim=-1)
