"""``scripts/gpu_check.sh`` on a machine without a GPU: it must stop at once and say why,
and its install and import stages (no pip, no network) must work from the source tree."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def _run(tmp_path, **env):
    if shutil.which("bash") is None or shutil.which("python3") is None:
        pytest.skip("needs bash and python3 on PATH")
    full = {**os.environ, "OUT": str(tmp_path), **env}
    full.pop("TRITON_INTERPRET", None)
    t0 = time.monotonic()
    res = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, env=full, timeout=120)
    return res, time.monotonic() - t0


def test_stops_fast_without_cuda(tmp_path):
    res, seconds = _run(tmp_path, CUDA_VISIBLE_DEVICES="")
    out = res.stdout + res.stderr
    assert res.returncode == 2, out
    assert "STOP: no CUDA device visible" in out and "CUDA_VISIBLE_DEVICES=''" in out, out
    assert "[parity]" not in out  # nothing after the environment stage ran
    assert seconds < 60
    assert "STOP: no CUDA device visible" in (tmp_path / "gpu_check.log").read_text()


def test_dry_run_installs_and_imports_from_the_source_tree(tmp_path):
    res, _ = _run(tmp_path, CUDA_VISIBLE_DEVICES="", GPU_CHECK_DRY_RUN="1")
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    assert "=== [import] exit 0" in out, out
    # the source tree through the script's own import mapping, not an installed copy
    assert f"rheoplan.kernels from {ROOT}/kernels/__init__.py | source-tree finder" in out, out


def test_e2e_module_refuses_without_cuda(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    res = subprocess.run([sys.executable, "-m", "rheoplan.bench.gpu_e2e", "--out", str(tmp_path)],
                         capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 2
    assert "no CUDA device" in res.stderr
