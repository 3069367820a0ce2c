"""``rheoplan bench kernels``' CUDA section, run on the CPU under the Triton interpreter at toy
sizes: every kernel call of the GPU benchmark goes through once, so a GPU run cannot fail
on an argument error (the times printed here mean nothing)."""

from __future__ import annotations

import io
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported


@pytest.mark.slow
def test_cuda_section_smoke_under_interpreter():
    if torch.cuda.is_available():
        pytest.skip("on a GPU the real section runs in scripts/gpu_check.sh")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("TRITON_INTERPRET is set to something else than 1 in the environment")
    from rheoplan.bench.kernels import cuda_section

    out = io.StringIO()
    cuda_section(160, 1, out, device="cpu", batches=(1,), prefix=32, heads=((4, 2, 16),))
    text = out.getvalue()
    for kernel in ("slot_expansion", "prune_topn", "linearize", "coupling_rows", "verify_walk", "tree_attention"):
        assert kernel in text, text
