"""``scripts/aot_sm90.py`` compiles kernels for sm_90 without a GPU (Triton's own LLVM and
ptxas). Here it checks that the slot-expansion kernels, compiled with the options their
launcher passes, sum lane-symmetrically: on an H200 the compiler fused a lane's own
product into the first butterfly step of a sum (an FMA with the partner lane's rounded
product), lanes got differently rounded sums, and equal logits got different q (ties
broken by lane; docs/gpu.md, "The first GPU run")."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_slot_expansion_sums_are_lane_symmetric_as_launched():
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)  # compiled kernels, not interpreted ones
    # the parity tests' 16-entry block and the chunk statistics' reduction (one entry per lane)
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "aot_sm90.py"), "S=16 ", "chunk_topk S=128 logits"],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    out = res.stdout + res.stderr
    assert "slot_expansion S=16 BLOCK=16" in out and "slot chunk_topk S=128 logits" in out, out
    assert "LANE-ASYMMETRIC" not in out, out
    assert res.returncode == 0, out
