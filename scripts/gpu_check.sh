#!/usr/bin/env bash
# The whole GPU proof in one command (docs/gpu.md says how to read its output).
#
#   bash scripts/gpu_check.sh                 # from anywhere; runs in the repository root
#   OUT=/some/dir bash scripts/gpu_check.sh   # results folder (default: ./gpu_check_out)
#
# Stages, each with its own time limit and exit status (a failing stage does not stop the
# later ones, except that nothing runs without a CUDA device or without an importable
# rheoplan), all inside 8 minutes:
#   0 environment   python3, torch, Triton, transformers versions; stops at once without CUDA
#   1 install       no network, no pip: the source tree on PYTHONPATH + an import mapping
#   2 import        rheoplan and every Triton kernel module import; stops if not
#   3 parity        pytest -m interpreter with TRITON_INTERPRET unset: every Triton kernel
#                   compiled for this GPU against its torch reference, and the tree-attention
#                   kernel inside tiny transformers Llama/Qwen2/Mistral verify forwards
#   3b diagnose     python3 scripts/gpu_diagnose.py: the slot-expansion tie case, CUDA Gumbel
#                   ulps, host against device time of a kernel call (docs/gpu.md, first run)
#   4 e2e           python3 -m rheoplan.bench.gpu_e2e: random-weight SmolLM2-135M (EAGLE-3
#                   head, self-draft) and Llama-1B shapes, bf16, backend triton / numba /
#                   generate, T = 0 and 1: tokens/s, ms per phase, syncs and launches per step
#   5 bench         python3 -m rheoplan.bench.kernels --cuda --no-cpu: per-kernel microseconds
#   6 resources     scripts/aot_sm90.py: registers / spills / shared memory per kernel (sm_90)
# Everything printed is also written to $OUT/gpu_check.log; stage files sit beside it.
set -u -o pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
OUT_DIR="${OUT:-$ROOT/gpu_check_out}"
mkdir -p "$OUT_DIR"
LOG="$OUT_DIR/gpu_check.log"
exec > >(tee -a "$LOG") 2>&1
TOTAL_LIMIT="${GPU_CHECK_LIMIT:-470}"  # seconds for the whole script (8 minutes, minus a margin)
T_START=$(date +%s)
declare -a SUMMARY=()

left() { echo $(( TOTAL_LIMIT - ($(date +%s) - T_START) )); }

# stage NAME LIMIT CMD...: run CMD under min(LIMIT, time left), record "NAME: exit N (Ts)"
stage() {
  local name=$1 limit=$2 rc t0 budget
  shift 2
  budget=$(left)
  if [ "$budget" -lt 15 ]; then
    echo "=== [$name] SKIPPED: ${budget}s left of ${TOTAL_LIMIT}s"
    SUMMARY+=("$name: skipped (time)")
    return 0
  fi
  [ "$limit" -gt "$budget" ] && limit=$budget
  echo "=== [$name] start $(date -u +%H:%M:%SZ), limit ${limit}s"
  t0=$(date +%s)
  timeout -k 5 "$limit" "$@"
  rc=$?
  local what="exit $rc"
  [ $rc -eq 124 ] || [ $rc -eq 137 ] && what="TIMED OUT after ${limit}s (exit $rc)"
  echo "=== [$name] $what in $(( $(date +%s) - t0 ))s"
  SUMMARY+=("$name: $what ($(( $(date +%s) - t0 ))s)")
  return $rc
}

finish() {
  echo
  echo "===== summary ($(( $(date +%s) - T_START ))s) ====="
  for line in "${SUMMARY[@]}"; do echo "  $line"; done
  echo "log: $LOG"
  exit "${1:-0}"
}

echo "===== rheoplan gpu_check $(date -u +%Y-%m-%dT%H:%M:%SZ) in $ROOT ====="
echo "--- git: $(git -C "$ROOT" log -1 --format='%h %s' 2>/dev/null || echo 'no git metadata')"

# 0. environment ---------------------------------------------------------------------------
command -v python3 >/dev/null || { echo "STOP: python3 not found"; SUMMARY+=("environment: no python3"); finish 2; }
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1
else
  echo "(no nvidia-smi on PATH)"
fi
# GPU_CHECK_DRY_RUN=1 (tests only): no CUDA needed, stops after the import stage
DRY="${GPU_CHECK_DRY_RUN:-0}"
stage environment 60 env GPU_CHECK_DRY_RUN="$DRY" python3 - <<'EOF'
import os, sys
import torch
print("python", sys.version.split()[0], "| torch", torch.__version__, "| cuda build", torch.version.cuda)
for mod in ("triton", "transformers", "numba", "numpy"):
    try:
        print(f"{mod} {__import__(mod).__version__}")
    except Exception as e:
        print(f"{mod}: NOT importable ({type(e).__name__}: {e})")
if os.environ.get("GPU_CHECK_DRY_RUN") == "1":
    print("dry run: the CUDA check is skipped")
    sys.exit(0)
if not torch.cuda.is_available():
    print(f"STOP: no CUDA device visible: torch.cuda.is_available() is False "
          f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}, torch {torch.__version__}). "
          "This script checks the Triton kernels compiled for a GPU; there is nothing to check without one.")
    sys.exit(3)
p = torch.cuda.get_device_properties(0)
print(f"device: {p.name}, sm_{p.major}{p.minor}, {p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs")
EOF
[ $? -eq 0 ] || finish 2

# 1. install without the network ------------------------------------------------------------
# No pip, no build backend, no writes outside $OUT_DIR: ROOT goes on PYTHONPATH (rheoplan/ is
# importable as it is), and a sitecustomize.py in $OUT_DIR/.site maps rheoplan.kernels and
# rheoplan.planner to kernels/ and planner/, as setuptools' package-dir does for an install.
SITE="$OUT_DIR/.site"
install_source_tree() {
  mkdir -p "$SITE" || return 1
  cat > "$SITE/sitecustomize.py" <<PYEOF || return 1
"""gpu_check.sh: import rheoplan.kernels / rheoplan.planner from the source tree (no install)."""
import importlib.abc, importlib.util, os, sys

_MAP = {"rheoplan.kernels": "$ROOT/kernels", "rheoplan.planner": "$ROOT/planner"}


class SourceTreeFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        folder = _MAP.get(name)
        if folder is None:
            return None
        return importlib.util.spec_from_file_location(name, os.path.join(folder, "__init__.py"),
                                                      submodule_search_locations=[folder])


sys.meta_path.insert(0, SourceTreeFinder())
PYEOF
}
export ROOT SITE
export -f install_source_tree  # timeout runs programs, not functions: through bash -c
stage install 30 bash -c install_source_tree || { echo "STOP: could not write $SITE/sitecustomize.py"; finish 2; }
export PYTHONPATH="$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1
unset TRITON_INTERPRET  # compiled kernels on the GPU, never the interpreter

# 2. import ------------------------------------------------------------------------------
stage import 60 python3 -c "
import rheoplan, rheoplan.planner
import rheoplan.kernels.tree_attention.triton, rheoplan.kernels.slot_expansion.triton
import rheoplan.kernels.plan.triton, rheoplan.kernels.verify.triton, rheoplan.kernels.philox_triton
import rheoplan.models.tree_attention, rheoplan.bench.gpu_e2e, rheoplan.bench.kernels
import sys
finder = any(type(f).__name__ == 'SourceTreeFinder' for f in sys.meta_path)
print('rheoplan imports from', rheoplan.__file__, '| rheoplan.kernels from', rheoplan.kernels.__file__,
      '| source-tree finder' if finder else '| NO source-tree finder (sitecustomize not loaded)')
" || { echo "STOP: rheoplan does not import (see the traceback above); nothing else can run"; finish 2; }
if [ "$DRY" = "1" ]; then
  echo "dry run: stopping before the GPU stages"
  finish 0
fi

# 3. parity: Triton kernels compiled for this GPU vs their references ----------------------
stage parity 170 python3 -m pytest -q -p no:cacheprovider -m interpreter -rfEs \
  --junitxml="$OUT_DIR/parity.xml" tests/kernels tests/rheoplan/models/test_tree_attention.py

# 3b. follow-ups of the first GPU run: slot-expansion ties, CUDA Gumbel ulps, host time per call
stage diagnose 60 python3 scripts/gpu_diagnose.py

# 4. end-to-end decode ---------------------------------------------------------------------
E2E_BUDGET=$(( $(left) - 75 ))  # keep ~75 s for the kernel benchmarks
[ "$E2E_BUDGET" -gt 200 ] && E2E_BUDGET=200
stage e2e $(( E2E_BUDGET + 25 )) python3 -m rheoplan.bench.gpu_e2e --out "$OUT_DIR" --budget "$E2E_BUDGET"

# 5. kernel micro-benchmarks -----------------------------------------------------------------
stage bench 70 python3 -m rheoplan.bench.kernels --cuda --no-cpu --reps 20 --vocab 128256 \
  --out "$OUT_DIR/bench_kernels.txt"
[ -f "$OUT_DIR/bench_kernels.txt" ] && cat "$OUT_DIR/bench_kernels.txt"

# 6. registers / spills / shared memory under this machine's Triton -------------------------
stage resources 60 python3 scripts/aot_sm90.py

finish 0
