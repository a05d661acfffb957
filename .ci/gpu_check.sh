#!/usr/bin/env bash
# The one prepared check for a lent GPU machine (H200: torch 2.11 + CUDA 13,
# Python 3.12, no network). Run from the repo root via the device tool:
#   run(command="bash .ci/gpu_check.sh", timeout_s=540)
# Builds _C_cuda for sm_90 only, runs the CUDA tests (kernels vs the reference
# backend, shared kernel checks) and the decode benchmark; everything lands in
# $OUT (build.log, pytest.log, junit.xml, bench.log, bench.json, env.json).
set -uo pipefail
OUT=${OUT:-/tmp/paged-gpu-check}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PAGED_CUDA_ARCHS=90 CMAKE_BUILD_PARALLEL_LEVEL=16
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/env.txt" 2>&1
$PY -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))" >> "$OUT/env.txt" 2>&1

# --no-deps: the serving dependencies (fastapi, gguf, ...) are not needed by
# these checks and cannot be fetched there.
echo "== build" | tee "$OUT/summary.txt"
if ! $PY -m pip install -q --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1; then
  echo "BUILD FAILED (see build.log)" | tee -a "$OUT/summary.txt"; tail -40 "$OUT/build.log"; exit 1
fi
$PY -c "import json; from paged.platforms.cuda import CudaPlatform; print(json.dumps(CudaPlatform().env_report()))" \
  > "$OUT/env.json" 2>&1

echo "== tests" | tee -a "$OUT/summary.txt"
timeout 300 $PY -m pytest -q -p no:cacheprovider tests/test_cuda_backend.py --junitxml="$OUT/junit.xml" \
  > "$OUT/pytest.log" 2>&1
test_rc=$?
tail -5 "$OUT/pytest.log" | tee -a "$OUT/summary.txt"

echo "== benchmark" | tee -a "$OUT/summary.txt"
timeout 180 $PY benchmarks/kernels_cuda.py --json "$OUT/bench.json" > "$OUT/bench.log" 2>&1
bench_rc=$?
head -n -1 "$OUT/bench.log" | tee -a "$OUT/summary.txt"
echo "tests rc=$test_rc bench rc=$bench_rc" | tee -a "$OUT/summary.txt"
exit $(( test_rc || bench_rc ))
