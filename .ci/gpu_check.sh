#!/usr/bin/env bash
# The one prepared check for a lent GPU machine (H200: torch 2.11 + CUDA 13,
# Python 3.12, 16 cores, no network). Run from the repo root via the device
# tool, with the serving wheels of .ci/gpu_wheels.txt fetched into .whl/:
#   run(command="bash .ci/gpu_check.sh", carry=[".whl"], timeout_s=420)
# Stage timeouts add up to 6.6 minutes at worst (build 150 s, tests 60 s,
# e2e 100 s, conformance 45 s, benchmarks 40 s); the expected total is under 5.
# Budget: under 5 minutes on a fresh machine, so a rerun fits in 15 minutes
# of device time. Each stage has its own timeout; a failed stage does not
# stop the others. Everything lands in $OUT (8 files at most come back):
#   summary.txt   one line per stage + the e2e and benchmark results
#   build.log pytest.log e2e.log e2e.json conformance.txt bench.log bench.json
# Stages: build _C_cuda for sm_90 (and check it really was: CMake skips
# csrc_cuda without nvcc and pip still succeeds) | the CUDA tests (kernels vs the reference
# backend at every head size, the shared kernel checks, MoE grouped GEMM vs the torch loop) | the engine end to
# end on a generated model (benchmarks/gpu_e2e.py: cuda vs cpu float32
# greedy in float32 and bfloat16, graphs vs --enforce-eager, two engines at
# --gpu-memory-utilization 0.45 side by side, each engine's memory freed,
# paged serve streaming a completion) | paged conformance --device cuda --quick |
# decode (% of copy bandwidth) and prefill (TFLOP/s vs torch SDPA) benchmarks.
set -uo pipefail
OUT=${OUT:-/tmp/paged-gpu-check}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PAGED_CUDA_ARCHS=90 CMAKE_BUILD_PARALLEL_LEVEL=16
S="$OUT/summary.txt"
start=$(date +%s)
stage() { echo "== $1 ($(( $(date +%s) - start )) s)" | tee -a "$S"; }
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"; } > "$S" 2>&1

if [ -d .whl ]; then  # carried serving dependencies (no network there)
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >> "$S" 2>&1 && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
else
  echo "no .whl/ carried: the engine stages need fastapi, pydantic, uvicorn, gguf, llguidance (.ci/gpu_wheels.txt)" | tee -a "$S"
fi

stage build
t0=$(date +%s)
if ! timeout 150 $PY -m pip install -q --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1; then
  echo "BUILD FAILED (see build.log)" | tee -a "$S"; tail -30 "$OUT/build.log"; exit 1
fi
# pip succeeds when CMake skipped csrc_cuda (nvcc not found): the module must
# exist and say it was compiled for exactly the archs asked for
if ! archs=$($PY -c "import paged._C_cuda as c; print(c.built_archs)" 2>>"$OUT/build.log") \
    || [ "$archs" != "${PAGED_CUDA_ARCHS//;/,}" ]; then
  echo "BUILD FAILED: paged._C_cuda built_archs '${archs:-<no module>}', expected '${PAGED_CUDA_ARCHS//;/,}'" \
    "(CMake skipped csrc_cuda? nvcc on PATH? see build.log)" | tee -a "$S"; tail -30 "$OUT/build.log"; exit 1
fi
echo "built _C_cuda for sm_$archs in $(( $(date +%s) - t0 )) s" | tee -a "$S"

stage tests
timeout 60 $PY -m pytest -q -p no:cacheprovider tests/test_cuda_backend.py tests/test_cuda_ids.py \
  tests/test_cuda_sizing.py tests/test_cuda_alignment.py tests/test_cuda_moe.py > "$OUT/pytest.log" 2>&1
test_rc=$?
tail -3 "$OUT/pytest.log" | tee -a "$S"

stage "engine end to end"
timeout 100 $PY benchmarks/gpu_e2e.py --out "$OUT" > "$OUT/e2e.log" 2>&1
e2e_rc=$?
grep -E "^(PASS|FAIL)" "$OUT/e2e.log" | tee -a "$S"
[ $e2e_rc -eq 0 ] || tail -15 "$OUT/e2e.log" | tee -a "$S"

stage conformance
timeout 45 $PY -m paged.core.entrypoints.cli conformance --device cuda --quick > "$OUT/conformance.txt" 2>&1
conf_rc=$?
tail -4 "$OUT/conformance.txt" | tee -a "$S"

stage benchmarks
timeout 40 $PY benchmarks/kernels_cuda.py --quick --json "$OUT/bench.json" > "$OUT/bench.log" 2>&1
bench_rc=$?
head -n -1 "$OUT/bench.log" | tee -a "$S"

echo "tests rc=$test_rc e2e rc=$e2e_rc conformance rc=$conf_rc bench rc=$bench_rc; $(( $(date +%s) - start )) s" \
  | tee -a "$S"
exit $(( test_rc || e2e_rc || conf_rc || bench_rc ))
