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
        assert r.returncode != 0 and "ModuleNotFoundError: No module named 'kernels'" in r.stderr, r.stderr


def test_transformers_imports_its_hub_kernels_from_the_root():
    pytest.importorskip("transformers")
    r = _run("import transformers.integrations.hub_kernels; import rheoplan.kernels as k; "
             "print(k.__name__, k.CACHE_GUARDED)")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[0] == "rheoplan.kernels"
