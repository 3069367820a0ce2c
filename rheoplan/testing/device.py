"""Count what a device step costs the host: Triton launches, device-to-host syncs, compiles.

* ``count_triton_launches()``: every ``kernel[grid](...)`` launch, by kernel name, compiled
  or interpreted (it wraps ``JITFunction.run`` and the interpreter's
  ``InterpretedFunction.run``, through which every launch goes); any kernel counts,
  tree attention included.
* ``count_host_syncs()``: device-to-host transfers.

  - On CUDA, torch's own sync debug mode (``torch.cuda.set_sync_debug_mode``) reports
    every synchronising call, explicit (``.item()``, ``.tolist()``, ``.cpu()``) or
    implicit (boolean-mask indexing, ``nonzero``); each report counts one.
  - On the CPU (tests, ``TRITON_INTERPRET=1``) nothing is transferred, so the explicit
    conversions a device would have to sync for are counted instead: ``.item()``,
    ``.tolist()``, ``.cpu()``, ``.numpy()``, ``int()``, ``float()``, ``bool()``,
    ``index()`` of a tensor, called from anywhere but the torch, numpy and Triton
    packages themselves (the interpreter reads its arguments on the host). Implicit
    syncs inside torch ops (boolean-mask indexing) are not seen on the CPU.
* ``count_triton_compiles()``: Triton specialisations first met (compiled or loaded).

Example:
    >>> import torch
    >>> with count_host_syncs() as syncs:
    ...     _ = torch.arange(3).tolist()
    >>> syncs.count if not torch.cuda.is_available() else 1
    1
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from collections import Counter
from dataclasses import dataclass, field

import torch


@dataclass
class LaunchCount:
    by_kernel: Counter = field(default_factory=Counter)

    @property
    def total(self) -> int:
        return sum(self.by_kernel.values())


@contextlib.contextmanager
def count_triton_launches():
    """Count Triton kernel launches inside the block (``.by_kernel``, ``.total``)."""
    import triton.runtime.jit as jit

    out = LaunchCount()
    classes = [jit.JITFunction]
    try:
        from triton.runtime.interpreter import InterpretedFunction

        classes.append(InterpretedFunction)
    except ImportError:  # pragma: no cover - old Triton
        pass
    originals = {cls: cls.run for cls in classes}

    def wrap(cls):
        orig = originals[cls]

        def run(self, *args, **kwargs):
            if not kwargs.get("warmup", False):
                out.by_kernel[getattr(self.fn, "__name__", repr(self.fn))] += 1
            return orig(self, *args, **kwargs)

        return run

    for cls in classes:
        cls.run = wrap(cls)
    try:
        yield out
    finally:
        for cls, orig in originals.items():
            cls.run = orig


@dataclass
class CompileCount(LaunchCount):
    supported: bool = True  #: False: this Triton has no cache hook, ``total`` means nothing


@contextlib.contextmanager
def count_triton_compiles():
    """Count the Triton specialisations first met inside the block (``.total``): each is a
    compile, or a load from Triton's on-disk cache, and either costs far more than a launch.
    Through ``triton.knobs.runtime.jit_cache_hook`` (chained to a hook already set); under
    the interpreter nothing compiles and the count stays 0. A timing with compiles in it
    is not a steady state (``rheoplan.bench.gpu_e2e`` times such a row again)."""
    out = CompileCount()
    try:
        from triton import knobs
    except ImportError:  # pragma: no cover - a Triton without knobs
        knobs = None
    if knobs is None or not hasattr(knobs.runtime, "jit_cache_hook"):
        out.supported = False  # nothing to count with: callers report "unknown", not 0
        yield out
        return
    before = knobs.runtime.jit_cache_hook

    def hook(*args, **kwargs):
        out.by_kernel[getattr(kwargs.get("fn"), "name", "kernel")] += 1  # a JitFunctionInfo
        return before(*args, **kwargs) if before else False

    knobs.runtime.jit_cache_hook = hook
    try:
        yield out
    finally:
        knobs.runtime.jit_cache_hook = before


@dataclass
class SyncCount:
    count: int = 0
    where: list = field(default_factory=list)  #: (file:line, what) of each counted sync


_LIBS = tuple(os.path.dirname(m.__file__) for m in (torch,) if getattr(m, "__file__", None))


def _lib_dirs() -> tuple[str, ...]:
    dirs = list(_LIBS)
    for name in ("numpy", "triton", "numba"):
        mod = sys.modules.get(name)
        if mod is not None and getattr(mod, "__file__", None):
            dirs.append(os.path.dirname(mod.__file__))
    return tuple(dirs)


@contextlib.contextmanager
def count_host_syncs():
    """Count device-to-host syncs inside the block (see the module docstring for how)."""
    out = SyncCount()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        prev = torch.cuda.get_sync_debug_mode()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                yield out
            finally:
                torch.cuda.set_sync_debug_mode(prev)
        for w in caught:
            if "synchroniz" in str(w.message):
                out.count += 1
                out.where.append((f"{w.filename}:{w.lineno}", str(w.message)[:80]))
        return
    libs = _lib_dirs()
    names = ("item", "tolist", "cpu", "numpy", "__int__", "__float__", "__bool__", "__index__")
    originals = {n: getattr(torch.Tensor, n) for n in names}
    depth = [0]  # a conversion that calls another (tolist -> item) counts once

    def wrap(name):
        orig = originals[name]

        def f(self, *args, **kwargs):
            caller = sys._getframe(1)
            if depth[0] == 0 and not caller.f_code.co_filename.startswith(libs):
                out.count += 1
                out.where.append((f"{caller.f_code.co_filename}:{caller.f_lineno}", name))
            depth[0] += 1
            try:
                return orig(self, *args, **kwargs)
            finally:
                depth[0] -= 1

        return f

    for n in names:
        setattr(torch.Tensor, n, wrap(n))
    try:
        yield out
    finally:
        for n, orig in originals.items():
            setattr(torch.Tensor, n, orig)
