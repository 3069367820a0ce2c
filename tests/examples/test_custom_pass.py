"""examples/custom_pass.py is documentation users copy: it must run and reach its verdicts
(a lossless pruning pass passes the oracle; a token-rewriting pass is caught)."""

from __future__ import annotations

import runpy
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "custom_pass.py"


def test_custom_pass_example_verdicts():
    mod = runpy.run_path(str(EXAMPLE))
    from rheoplan.pipeline import FnPass

    assert mod["tv_with"](FnPass("drop_unlikely", mod["drop_unlikely"])) < 1e-9
    assert mod["tv_with"](FnPass("tame_sampled", mod["tame_sampled"])) > 1e-3
