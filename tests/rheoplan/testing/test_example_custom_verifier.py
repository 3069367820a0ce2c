"""examples/check_custom_verifier.py runs and reaches the right verdicts."""

from __future__ import annotations

import runpy
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "check_custom_verifier.py"


def test_example_verdicts(capsys):
    ns = runpy.run_path(str(EXAMPLE))
    assert ns["main"]() == 0
    out = capsys.readouterr().out
    assert "my_rheo" in out and "lossless" in out and "LOSSY" in out
