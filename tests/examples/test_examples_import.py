"""Every script in examples/ still imports what it uses: each is loaded as a module (its
imports and definitions run, not its ``main``), and a script with a command line answers
``--help``. Catches a renamed public name or a moved module before a user does; the
examples' own results are checked by their own tests and by the docs they feed."""

from __future__ import annotations

import runpy
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.py"))


def test_there_are_examples():
    assert len(EXAMPLES) >= 5


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_loads(path):
    names = runpy.run_path(str(path), run_name="example_under_test")
    assert callable(names.get("main")), f"{path.name} has no main()"


@pytest.mark.parametrize("path", [p for p in EXAMPLES if "argparse" in p.read_text()], ids=lambda p: p.name)
def test_example_help(path):
    out = subprocess.run([sys.executable, str(path), "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "usage:" in out.stdout
