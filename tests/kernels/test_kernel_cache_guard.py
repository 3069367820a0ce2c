"""``rheoplan.kernels`` keys numba's on-disk cache of every kernel by all kernel sources
(``kernels/__init__.py``): a kernel calling another file's kernel, or compiling in another
module's constant, must not keep running a cached old version after that file changed."""

from __future__ import annotations

import importlib

import numba
import pytest

import rheoplan.kernels as kernels

MODULES = ["gumbel", "philox", "noise", "linear.cpu", "plan.cpu", "plan.cpu_pass", "slot_expansion.cpu",
           "slot_expansion.cpu_pass", "verify.cpu"]


def _cached_kernels():
    for name in MODULES:
        mod = importlib.import_module(f"rheoplan.kernels.{name}")
        for attr, obj in vars(mod).items():
            if isinstance(obj, numba.core.registry.CPUDispatcher) and obj.__module__ == mod.__name__ \
                    and getattr(obj, "_cache", None) is not None and hasattr(obj._cache, "_impl"):
                yield f"{name}.{attr}", obj


def test_every_cached_kernel_is_keyed_by_all_kernel_sources():
    if not kernels.CACHE_GUARDED:
        pytest.skip("this numba lays its cache out otherwise")
    seen = list(_cached_kernels())
    assert len(seen) >= 15  # the whole numba side, not a few
    for name, k in seen:
        loc = k._cache._impl.locator
        assert type(loc).__name__.startswith("Rheoplan"), name
        stamp = loc.get_source_stamp()
        assert isinstance(stamp, tuple) and stamp[1] == kernels.source_digest(), name


def test_the_digest_covers_the_called_kernels_and_the_compiled_in_constants(tmp_path):
    names = [n for n, _ in kernels.source_files()]
    for want in ("gumbel.py", "philox.py", "verify/cpu.py", "rheoplan/distributions.py", "rheoplan/verify.py"):
        assert want in names
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("x = 1\n")
    b.write_text("y = 2\n")
    before = kernels.digest_sources([("a.py", a), ("b.py", b)])
    b.write_text("y = 3\n")
    assert kernels.digest_sources([("a.py", a), ("b.py", b)]) != before


def test_functions_outside_the_kernels_keep_numbas_own_cache(tmp_path):
    if not kernels.CACHE_GUARDED:
        pytest.skip("this numba lays its cache out otherwise")
    from numba.core import caching

    ours = [c for c in caching.CacheImpl._locator_classes if c.__name__.startswith("Rheoplan")]
    assert len(ours) == 3
    src = tmp_path / "elsewhere.py"
    src.write_text("def f():\n    return 1\n")
    ns = {}
    exec(compile(src.read_text(), str(src), "exec"), ns)
    assert all(c.from_function(ns["f"], str(src)) is None for c in ours)


def test_the_walks_node_draw_is_saved_to_the_cache(tmp_path):
    """``walk_node_draw`` compiles in a fresh process and writes its cache entry, with no
    warning: a kernel that reads a dynamic global (``numba.get_num_threads()`` inside it,
    as a first version of the split draw did) cannot be cached and is compiled again in
    every process, ~seconds at the first walk."""
    import subprocess
    import sys

    code = ("import numpy as np, warnings\n"
            "warnings.simplefilter('error')\n"
            "from rheoplan.kernels.verify.cpu import walk_node_draw\n"
            "V = 9000\n"
            "walk_node_draw(np.full(V, 1.0 / V), np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float32), 0, 1, 3,"
            " -1, 1, np.uint64(3), np.zeros(4, dtype=np.uint64), np.arange(4, dtype=np.uint64), np.zeros(V), 2)\n")
    env = {**__import__("os").environ, "NUMBA_CACHE_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "Cannot cache" not in out.stderr
    assert list(tmp_path.rglob("*walk_node_draw*.nbi")), "no cache index written for walk_node_draw"
