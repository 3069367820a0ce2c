#!/usr/bin/env bash
# GPU check for the kernels: install, run the kernel parity tests on CUDA (compiled
# Triton, not the interpreter), then the benchmarks. Finishes in < 10 min on one GPU.
# Results go to ${RESULTS:-gpu_check_results.txt} (appended, with a header per run).
#
#   bash scripts/gpu_check.sh            # from the repository root
#   RESULTS=/tmp/r.txt bash scripts/gpu_check.sh
set -u
cd "$(dirname "$0")/.."
RESULTS="${RESULTS:-gpu_check_results.txt}"
{
  echo "===== rheoplan gpu_check $(date -u +%Y-%m-%dT%H:%M:%SZ) ====="
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 || true
} >> "$RESULTS"

timeout 150 pip install -q -e ".[test]" >> "$RESULTS" 2>&1 || echo "pip install failed or timed out" >> "$RESULTS"
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.cuda.is_available())" >> "$RESULTS" 2>&1

# With CUDA present, tests/kernels/conftest.py does not set TRITON_INTERPRET: the Triton
# tests compile and run on the GPU. unset it in case the environment has it.
echo "--- parity tests (tests/kernels) ---" >> "$RESULTS"
env -u TRITON_INTERPRET timeout 180 python -m pytest -q -p no:cacheprovider tests/kernels >> "$RESULTS" 2>&1
echo "pytest exit: $?" >> "$RESULTS"

echo "--- benchmarks ---" >> "$RESULTS"
env -u TRITON_INTERPRET timeout 200 rheoplan bench kernels --cuda --reps 10 --ref-reps 1 \
  --out "$RESULTS" >> "$RESULTS" 2>&1
echo "bench exit: $?" >> "$RESULTS"
echo "results in $RESULTS"
