"""Reference of the few-row linear product: ``y = x @ W.T + b``, torch's own."""

from __future__ import annotations

import torch


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., K]``, ``weight [N, K]``, ``bias [N]`` or None -> ``[..., N]``."""
    return torch.nn.functional.linear(x, weight, bias)
