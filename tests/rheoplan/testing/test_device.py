"""``rheoplan.testing.device.count_triton_compiles``: it counts what Triton reports through
its cache hook (each specialisation met for the first time), chains to a hook already
set, and puts it back. (That Triton calls the hook when it compiles is seen on a GPU
only: ``rheoplan.bench.gpu_e2e`` records it per row.)"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from rheoplan.testing.device import count_triton_compiles


def test_counts_the_cache_hook_chains_and_restores():
    knobs = pytest.importorskip("triton").knobs
    seen = []

    def earlier(*args, **kwargs):
        seen.append(kwargs["fn"].name)
        return False

    before = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = earlier
    try:
        with count_triton_compiles() as compiles:
            for name in ("slot_expansion_kernel", "topk_kernel", "slot_expansion_kernel"):
                assert knobs.runtime.jit_cache_hook(key=name, fn=SimpleNamespace(name=name)) is False
        assert compiles.total == 3
        assert compiles.by_kernel == {"slot_expansion_kernel": 2, "topk_kernel": 1}
        assert seen == ["slot_expansion_kernel", "topk_kernel", "slot_expansion_kernel"]
        assert knobs.runtime.jit_cache_hook is earlier
    finally:
        knobs.runtime.jit_cache_hook = before


def test_nothing_compiles_under_the_interpreter_or_outside_the_block():
    knobs = pytest.importorskip("triton").knobs
    before = knobs.runtime.jit_cache_hook
    with count_triton_compiles() as compiles:
        pass
    assert compiles.total == 0 and compiles.supported and knobs.runtime.jit_cache_hook is before


def test_a_triton_without_the_hook_reports_unknown(monkeypatch):
    knobs = pytest.importorskip("triton").knobs
    monkeypatch.delattr(type(knobs.runtime), "jit_cache_hook", raising=False)
    monkeypatch.delattr(knobs.runtime, "jit_cache_hook", raising=False)
    with count_triton_compiles() as compiles:
        pass
    assert not compiles.supported
