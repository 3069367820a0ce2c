"""examples/with_checkout.py runs a script with rheoplan, rheoplan.planner and
rheoplan.kernels taken from another checkout (the before/after measurements of
docs/results.md run the old code this way), and refuses a folder that is not one."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "with_checkout.py"


def _fake_checkout(root: Path) -> None:
    for pkg, mark in (("rheoplan", "top"), ("planner", "planner"), ("kernels", "kernels")):
        (root / pkg).mkdir(parents=True)
        (root / pkg / "__init__.py").write_text(f"MARK = {mark!r}\n")
    (root / "kernels" / "plan").mkdir()
    (root / "kernels" / "plan" / "__init__.py").write_text("")
    (root / "kernels" / "plan" / "cpu.py").write_text("MARK = 'old kernel'\n")


def test_the_script_sees_the_other_checkout(tmp_path):
    _fake_checkout(tmp_path / "co")
    script = tmp_path / "show.py"
    script.write_text("import sys, rheoplan, rheoplan.planner, rheoplan.kernels.plan.cpu as k\n"
                      "print(rheoplan.MARK, rheoplan.planner.MARK, k.MARK, sys.argv[1:])\n")
    out = subprocess.run([sys.executable, str(EXAMPLE), str(tmp_path / "co"), str(script), "--flag", "7"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "top planner old kernel ['--flag', '7']"


def test_a_folder_that_is_not_a_checkout_is_refused(tmp_path):
    out = subprocess.run([sys.executable, str(EXAMPLE), str(tmp_path), "x.py"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode != 0 and "no planner, kernels, rheoplan package there" in out.stderr
