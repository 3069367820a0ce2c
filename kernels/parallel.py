"""Launching numba's parallel kernels from a torch program: one thread count, one rule.

Every ``parallel=True`` kernel of the project (the few-row products,
``kernels.linear.cpu``; a batch's root draws, ``kernels.verify.cpu.root_draws``) is
launched through ``launch``, which

* gives numba the share of the cores torch's own products use (``torch.get_num_threads()``,
  capped by numba's pool): numba's setting is per Python thread, so it is set again
  whenever torch's changed in that thread;
* serialises the launches where numba runs its ``workqueue`` threading layer (neither
  OpenMP nor TBB found), which aborts the process when two Python threads launch parallel
  kernels at once (a server decoding in threads would). Which layer numba uses is known
  only after its first parallel launch, so the first call takes the lock too.
"""

from __future__ import annotations

import threading

import numba
import torch

_LOCK = threading.Lock()
_one_at_a_time = [True]

# per Python thread (numba's setting is per thread): torch's thread count when numba's was
# last set (``torch``) and what it was set to (``n``)
_threads = threading.local()


def threads() -> int:
    """The threads a parallel kernel launched now from this Python thread runs on (set in
    numba): torch's thread count, at most numba's pool."""
    n = torch.get_num_threads()
    if getattr(_threads, "torch", 0) != n:
        _threads.torch, _threads.n = n, min(n, numba.config.NUMBA_NUM_THREADS)
        numba.set_num_threads(_threads.n)
    return _threads.n


def launch(kernel, *args):
    """``kernel(*args)`` on ``threads()`` threads, one launch at a time under the
    ``workqueue`` layer; returns what the kernel returns."""
    threads()
    if _one_at_a_time[0]:
        with _LOCK:
            out = kernel(*args)
            _one_at_a_time[0] = numba.threading_layer() == "workqueue"
        return out
    return kernel(*args)
