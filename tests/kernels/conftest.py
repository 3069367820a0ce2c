"""Kernel tests: on a machine without CUDA, Triton kernels run under the interpreter.

``TRITON_INTERPRET`` must be set before ``triton`` is first imported, hence here.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def device() -> str:
    """Where Triton kernels run: CUDA when present, else CPU tensors under the interpreter."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def _logit_rows(n: int, V: int, seed: int) -> torch.Tensor:
    """``[n, V]`` float32 logits: normal, tied (quantised), with -inf, near one-hot, flat."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, V, generator=g) * 3
    for j in range(n):
        kind = j % 5
        if kind == 1:  # many exact ties
            x[j] = torch.round(x[j])
        elif kind == 2:  # some impossible tokens
            x[j, torch.rand(V, generator=g) < 0.3] = float("-inf")
            x[j, 0] = 0.0
        elif kind == 3:  # near one-hot: the tail carries (almost) no mass
            x[j] = torch.zeros(V)
            x[j, V // 2] = 200.0
        elif kind == 4:  # flat
            x[j] = 0.0
    return x


@pytest.fixture(scope="session")
def logit_rows():
    """``logit_rows(n, V, seed) -> [n, V]`` random rows with ties, -inf, near one-hot, flat."""
    return _logit_rows
