"""Suite-wide fixtures.

Every pipeline run in the test suite (``plan_tree``, ``run_pipeline``, the decode loop)
has the IR linted after every pass: the autouse fixture below adds a
``VerifyAfterEach`` instrument to the instruments that ``RHEOPLAN_DEBUG`` selects, so a
pass that leaves an ill-formed tree fails the test that ran it, naming the pass.

Opt out (e.g. a test that plans thousands of trees, or one that checks
``debug_instruments`` itself) with ``@pytest.mark.no_ir_lint``.
"""

from __future__ import annotations

import os

import pytest
import torch

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
