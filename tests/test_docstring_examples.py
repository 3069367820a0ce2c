"""Every docstring example (``>>>``) in ``rheoplan``, ``planner`` and ``kernels`` runs and
prints what it shows. Collected here, from the installed module names (``planner/`` and
``kernels/`` install as ``rheoplan.planner`` / ``rheoplan.kernels``), so the README's test
command runs them; one test per docstring. Docstrings of the modules in ``REALMODEL``
load SmolLM2-135M and run in the real-model group (``-m realmodel``)."""

from __future__ import annotations

import doctest
import importlib
import os

import pytest
import torch

# Collecting imports every module, the Triton kernels included: as in tests/kernels/conftest.py,
# without CUDA they must see TRITON_INTERPRET=1 before triton is first imported, whatever
# test file runs first.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from _package import PACKAGES, modules

FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
#: modules whose examples load the real model
REALMODEL = {"rheoplan.models.smollm"}


def _docstring_tests() -> list[doctest.DocTest]:
    finder = doctest.DocTestFinder()
    out = []
    for name in modules(PACKAGES):
        module = importlib.import_module(name)
        out += [t for t in finder.find(module, name) if t.examples]
    return sorted(out, key=lambda t: t.name)


TESTS = _docstring_tests()


def test_the_collector_finds_the_examples():
    names = {t.name for t in TESTS}
    assert "rheoplan.decode.plan_and_decode" in names
    assert any(n.startswith("rheoplan.kernels.") for n in names)
    assert sum(len(t.examples) for t in TESTS) > 100


def _param(t: doctest.DocTest):
    real = any(t.name == m or t.name.startswith(m + ".") for m in REALMODEL)
    marks = [pytest.mark.realmodel, pytest.mark.slow] if real else []
    return pytest.param(t, id=t.name, marks=marks)


@pytest.mark.parametrize("test", [_param(t) for t in TESTS])
def test_docstring_example(test, request):
    if request.node.get_closest_marker("realmodel"):
        request.getfixturevalue("one_torch_thread")  # much faster on a small shared machine
    runner = doctest.DocTestRunner(optionflags=FLAGS)
    out: list[str] = []
    result = runner.run(test, out=out.append, clear_globs=True)
    assert result.failed == 0, "".join(out)
