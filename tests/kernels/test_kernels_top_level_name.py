"""From a checkout's root, ``import kernels`` is Hugging Face's package, not the folder
``kernels/`` (which installs as ``rheoplan.kernels``): transformers 5.25 depends on
Hugging Face's ``kernels`` and imports it when loading a model, and ``python -m`` from the
root puts that folder first on ``sys.path`` (``kernels/__init__.py``, ``_hand_over_the_name``)."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys

import pytest
from _package import ROOT


def _run(code: str) -> subprocess.CompletedProcess:
    # -c puts the working directory first on sys.path, as python -m does
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)


def _hf_kernels_installed() -> bool:
    try:
        importlib.metadata.version("kernels")
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def test_import_kernels_from_the_root_is_not_the_checkouts_folder():
    r = _run("import kernels, pathlib; print(pathlib.Path(kernels.__file__).resolve())")
    if _hf_kernels_installed():
        assert r.returncode == 0, r.stderr
        assert not r.stdout.strip().startswith(str(ROOT / "kernels")), r.stdout
    else:
        assert r.returncode != 0, r.stdout  # the stand-in has no __file__ (see the test below)


#: run before the code under test: Hugging Face's ``kernels`` made unfindable off the
#: checkout's folder (the top-level import, ``path=None``, still finds the folder)
_HIDE_HF_KERNELS = """
import importlib.machinery as m
_find = m.PathFinder.find_spec
def _hidden(name, path=None, target=None):
    return None if name == "kernels" and path is not None else _find(name, path, target)
m.PathFinder.find_spec = staticmethod(_hidden)
"""


def test_without_hf_kernels_the_name_reads_as_a_namespace_shadow():
    """Where Hugging Face's ``kernels`` is not installed, ``import kernels`` from the root
    gives a module that transformers' availability check counts as a shadow, not an install
    (no ``__file__``, no ``__version__``), and names from it fail to import. Raising instead
    broke transformers 5.17's model imports on the GPU machine."""
    r = _run(_HIDE_HF_KERNELS + """
import kernels, sys
assert kernels is sys.modules["kernels"]
print(getattr(kernels, "__file__", None), getattr(kernels, "__version__", "N/A"))
try:
    from kernels import get_kernel
except ImportError:
    print("ImportError")
import rheoplan.kernels as k
print(k.__name__)
""")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["None", "N/A", "ImportError", "rheoplan.kernels"], r.stdout


def test_transformers_imports_its_hub_kernels_from_the_root():
    pytest.importorskip("transformers")
    r = _run("import transformers.integrations.hub_kernels; import rheoplan.kernels as k; "
             "print(k.__name__, k.CACHE_GUARDED)")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[0] == "rheoplan.kernels"
