"""Which implementation runs the planner passes and the verification walk.

One pass list, several backends (``rheoplan.pipeline.lower``):

==============  =========================================================================
``reference``   the readable torch passes of ``planner/*.py`` and ``rheoplan.verify.walk``
``numba``       numba CPU kernels (``kernels/*/cpu*.py``); planner tensors on the CPU
                (with a CUDA target too: draft logits come to the host once per depth)
``triton``      Triton kernels (``kernels/*/triton*.py``); planner tensors, noise and the
                walk on the target's device, a constant number of host syncs per step
``auto``        ``triton`` when the target is on a CUDA device, else ``numba``
==============  =========================================================================

``triton`` needs a CUDA device, or ``TRITON_INTERPRET=1`` (Triton's CPU interpreter, for
tests: slow, but the same kernels).
"""

from __future__ import annotations

import os

import torch

#: every name ``backend=`` accepts
BACKENDS = ("auto", "reference", "numba", "triton")


def interpreting() -> bool:
    """Whether Triton runs its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def check_backend(backend) -> str:
    """``backend`` if it is one of ``BACKENDS``, else a ``ValueError`` naming the allowed values."""
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")
    return backend


def resolve_backend(backend: str, device: torch.device | str | None = None) -> str:
    """The concrete backend for ``backend`` on ``device`` (the target's; default CPU).

    ``auto`` picks ``triton`` on CUDA and ``numba`` elsewhere. ``triton`` without a CUDA
    device and without ``TRITON_INTERPRET=1`` raises here, before any model work.

    Example:
        >>> resolve_backend("auto", "cpu")
        'numba'
    """
    check_backend(backend)
    dev = torch.device(device if device is not None else "cpu")
    if backend == "auto":
        return "triton" if dev.type == "cuda" else "numba"
    if backend == "triton":
        if dev.type != "cuda" and not interpreting():
            raise ValueError(f"backend='triton' needs the target on a CUDA device (it is on {dev}) or "
                             "TRITON_INTERPRET=1 (Triton's CPU interpreter); allowed on this machine: "
                             "'auto', 'reference', 'numba'")
        try:
            import triton  # noqa: F401
        except ImportError as exc:
            raise ValueError(f"backend='triton' needs the triton package ({exc}); allowed without it: "
                             "'auto', 'reference', 'numba'") from None
    return backend
