"""Suite-wide fixtures.

Every pipeline run in the test suite (``plan_tree``, ``run_pipeline``, the decode loop)
has the IR linted after every pass: the autouse fixture below adds a
``VerifyAfterEach`` instrument to the instruments that ``RHEOPLAN_DEBUG`` selects, so a
pass that leaves an ill-formed tree fails the test that ran it, naming the pass.

Opt out (e.g. a test that plans thousands of trees, or one that checks
``debug_instruments`` itself) with ``@pytest.mark.no_ir_lint``.

The suite keeps a cache of its own (``RHEOPLAN_CACHE_DIR``, a temporary folder removed at
exit): what it measures while it loads the machine (the dtype ``--dtype auto`` picks, the
cost model's latencies, the output projection's) must not become the choices a user's
later ``rheoplan generate`` reads from ``~/.cache/rheoplan``, and a user's cache must not
change what a test sees. ``RHEOPLAN_TEST_CACHE_DIR=DIR`` keeps it in ``DIR`` instead, so
that reruns skip the GGUF conversion (about 0.5 GB) and the measurements.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import pytest
import torch

_cache = os.environ.get("RHEOPLAN_TEST_CACHE_DIR")
if not _cache:
    _cache = tempfile.mkdtemp(prefix="rheoplan-test-cache-")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
os.environ["RHEOPLAN_CACHE_DIR"] = _cache  # subprocesses (the CLI tests) inherit it

# Without CUDA, Triton kernels (the 'triton' backend included) run under Triton's CPU
# interpreter. It must be chosen before triton is first imported, hence here.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config):
    config.addinivalue_line("markers", "no_ir_lint: do not lint the IR after every pass in this test")


@pytest.fixture(autouse=True)
def _lint_ir_after_every_pass(request, monkeypatch):
    if request.node.get_closest_marker("no_ir_lint"):
        yield
        return
    from rheoplan import pipeline

    original = pipeline.debug_instruments

    def with_verify():
        out = original()
        if not any(isinstance(i, pipeline.VerifyAfterEach) for i in out):
            out.append(pipeline.VerifyAfterEach())
        return out

    monkeypatch.setattr(pipeline, "debug_instruments", with_verify)
    yield


@pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op torch thread for a module of tiny-model tests (much faster than many
    threads on a small shared machine); restores the previous count afterwards."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
