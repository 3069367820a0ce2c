"""The small operations of a decoder layer around its products, fused: the RMS norm, a
residual sum with the norm after it, the rotary embedding of the queries or keys.

``reference`` writes transformers' Llama formulas as torch operators (eight for a norm);
``cpu`` does each function in one numba call for bfloat16 on the CPU, with the
reference's bits (a norm's sum of squares in torch's own summation order: ``cpu``'s
docstring). The functions here take the kernel where it applies (bfloat16 CPU tensors,
evenly strided rows, contiguous weights and angles, a norm where ``cpu.norm_applies``)
and the reference elsewhere. ``rheoplan.models.lean_llama`` calls them when its model's glue is
fused (``lean_llama.fuse_glue``, where it measured faster).
"""

from __future__ import annotations

import torch

from rheoplan.kernels.decoder_glue import cpu, reference

#: most rows (tokens) a caller should hand the kernels: they do a row at a time, so more
#: rows (a prompt's prefill) are faster as torch's operators (a residual sum and its norm,
#: warm, on the 2-core Zen 4 AMD EPYC: 4 rows 13 us fused against 22, 16 rows 28 against
#: 28, 32 rows 47 against 34)
MAX_ROWS = 16


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``reference.rms_norm``."""
    stride = cpu.row_stride(x)
    if stride is not None and cpu.applies(x, weight) and weight.is_contiguous() and cpu.norm_applies():
        return cpu.rms_norm(x, stride, weight, eps)
    return reference.rms_norm(x, weight, eps)


def add_rms_norm(hidden: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``reference.add_rms_norm``."""
    stride = cpu.row_stride(delta)
    if (stride is not None and hidden.shape == delta.shape and cpu.applies(hidden, delta, weight)
            and hidden.is_contiguous() and weight.is_contiguous() and cpu.norm_applies()):
        return cpu.add_rms_norm(hidden, delta, stride, weight, eps)
    return reference.add_rms_norm(hidden, delta, weight, eps)


def rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, head_dim: int) -> torch.Tensor:
    """``reference.rope``."""
    stride = cpu.row_stride(x)
    rows = x.shape[:-1]
    if (stride is not None and cos.shape[:-1] == rows and signed_sin.shape[:-1] == rows
            and cos.shape[-1] == head_dim == signed_sin.shape[-1] and head_dim % 2 == 0
            and x.shape[-1] % head_dim == 0 and cpu.applies(x, cos, signed_sin)
            and cos.is_contiguous() and signed_sin.is_contiguous()):
        return cpu.rope(x, stride, cos, signed_sin, head_dim)
    return reference.rope(x, cos, signed_sin, head_dim)
