"""The small operations of a decoder layer around its products, fused: the RMS norm, a
residual sum with the norm after it, the rotary embedding of the queries or keys, and a
layer's q | k | v product up to the attention (queries roped, keys roped and values
appended to the KV cache's buffers, ``rope_qkv_append``).

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


def rope_qkv_append(qkv: torch.Tensor, q_heads: int, cos: torch.Tensor, signed_sin: torch.Tensor, head_dim: int,
                    key_buf: torch.Tensor, value_buf: torch.Tensor, at: int) -> torch.Tensor:
    """``reference.rope_qkv_append``: one kernel call where ``qkv [B, T, ...]`` has evenly
    strided rows, the angles are ``[B, T, head_dim]`` and contiguous, and the buffers are
    contiguous, of one shape, ``B`` rows, with room for ``T`` columns at ``at``."""
    stride = cpu.row_stride(qkv)
    if (stride is not None and qkv.dim() == 3 and key_buf.dim() == 4 and key_buf.shape == value_buf.shape
            and cos.shape == signed_sin.shape == (*qkv.shape[:-1], head_dim) and head_dim % 2 == 0
            and key_buf.shape[3] == head_dim and key_buf.shape[0] == qkv.shape[0]
            and qkv.shape[-1] == (q_heads + 2 * key_buf.shape[1]) * head_dim
            and 0 <= at <= key_buf.shape[2] - qkv.shape[1]
            and cpu.applies(qkv, cos, signed_sin, key_buf, value_buf) and cos.is_contiguous()
            and signed_sin.is_contiguous() and key_buf.is_contiguous() and value_buf.is_contiguous()):
        return cpu.rope_qkv_append(qkv, stride, q_heads, cos, signed_sin, head_dim, key_buf, value_buf, at)
    return reference.rope_qkv_append(qkv, q_heads, cos, signed_sin, head_dim, key_buf, value_buf, at)
