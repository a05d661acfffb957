#!/usr/bin/env bash
# aarch64 stage of CI (run by .ci/run after the README test command):
# cross-builds the real paged._C_cpu extension and the C++ kernel drivers for
# aarch64 Linux with cmake/aarch64-linux-gnu.cmake, then runs the drivers
# (statically linked) under qemu-aarch64 once per dispatch level, choosing
# the emulated CPU so that level is the one auto picks:
#   cortex-a53   ARMv8.0 NEON, no dotprod     -> attention neon, linear neon
#   neoverse-n1  ARMv8.2 + dotprod            -> attention neon, linear dotprod
#   max          + i8mm, SVE, bf16            -> attention neon, linear i8mm
#   max with PAGED_CPU_HIDE=neon              -> scalar everywhere
# then, from a second build without OpenMP, the std::thread pool's checks.
# Each driver checks every build the CPU runs against the scalar build
# (csrc_cpu/tests/kernel_*_driver.cpp). Needs: g++-aarch64-linux-gnu,
# qemu-user and the arm64 Python headers (libpython3.X-dev:arm64, Debian
# multiarch), installed here when missing (root or sudo). Prints timings.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
stamp() { echo "arm64: $* ($(( $(date +%s) - start )) s)"; }

PY=${PY:-.venv/bin/python}
pyver=$("$PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
triple=aarch64-linux-gnu
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"

need=()
command -v $triple-g++ >/dev/null || need+=(g++-$triple)
command -v qemu-aarch64 >/dev/null || need+=(qemu-user)
[ -f /usr/include/$triple/python$pyver/pyconfig.h ] || need+=("libpython$pyver-dev:arm64")
if [ ${#need[@]} -gt 0 ]; then
  stamp "installing ${need[*]}"
  dpkg --print-foreign-architectures | grep -qx arm64 || $sudo dpkg --add-architecture arm64
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
[ -f /usr/include/python$pyver/Python.h ] || { echo "arm64: no /usr/include/python$pyver (Debian's python$pyver headers)" >&2; exit 1; }

# Debian's pyconfig.h includes <aarch64-linux-gnu/python3.X/pyconfig.h>: a
# staging include dir gives the cross compiler that path without /usr/include
# (the host's glibc headers) on its search path.
build=build/arm64
inc=$build/pyinclude
mkdir -p "$inc/$triple"
ln -sfn /usr/include/python$pyver "$inc/python$pyver"
ln -sfn /usr/include/$triple/python$pyver "$inc/$triple/python$pyver"

stamp "configuring"
cmake -S . -B "$build" -DCMAKE_TOOLCHAIN_FILE="$PWD/cmake/aarch64-linux-gnu.cmake" -DCMAKE_BUILD_TYPE=Release \
  -DPython_EXECUTABLE="$PWD/$PY" -DPython_INCLUDE_DIR="$PWD/$inc/python$pyver" \
  -DSKBUILD_SOABI="cpython-${pyver/./}-$triple" -DCMAKE_CXX_FLAGS="-isystem $PWD/$inc" \
  -DPAGED_BUILD_CUDA=OFF -DPAGED_STATIC_DRIVERS=ON >/dev/null
stamp "building _C_cpu and the kernel drivers"
# (static glibc warns that libgomp's dlopen needs glibc's own shared objects
# at run time: the drivers never reach it)
cmake --build "$build" -j"$(nproc)" --target _C_cpu kernel_attention_driver kernel_linear_driver 2>&1 |
  { grep -E "warning|error" | grep -v "Using 'dlopen' in statically linked" || true; }
so=$(ls "$build"/csrc_cpu/_C_cpu*.so)
$triple-readelf -h "$so" | grep -q "Machine:.*AArch64" || { echo "arm64: $so is not an aarch64 ELF" >&2; exit 1; }
stamp "built $so ($(du -k "$so" | cut -f1) KiB, aarch64)"

run() {  # run <qemu cpu> <env> <expected builds...>
  local cpu=$1 env=$2
  shift 2
  for driver in kernel_attention_driver kernel_linear_driver; do
    local t0=$(date +%s)
    env OMP_NUM_THREADS=2 $env qemu-aarch64 -cpu "$cpu" "$build/csrc_cpu/$driver" "$@"
    stamp "$driver on -cpu $cpu ${env:+($env) }passed in $(( $(date +%s) - t0 )) s"
  done
}
run cortex-a53 "" attention=neon linear=neon has=asimd lacks=dotprod,sve
run neoverse-n1 "" attention=neon linear=dotprod has=asimd,dotprod,fp16 lacks=sve
run max "" attention=neon linear=i8mm has=dotprod,sve,i8mm,bf16
run max "PAGED_CPU_HIDE=neon" attention=scalar linear=scalar lacks=asimd,dotprod,sve

# The std::thread pool of a build without OpenMP (what Apple clang without
# libomp gets): its own checks and the attention kernel on it. (The OpenMP
# build's parallel_driver is not run here: under qemu-user, libgomp aborts in
# about 1 run of 15 when several threads open OpenMP teams at once; natively
# it passes 40 of 40, and the pool build here 20 of 20.)
pool=build/arm64-no-openmp
cmake -S . -B "$pool" -DCMAKE_TOOLCHAIN_FILE="$PWD/cmake/aarch64-linux-gnu.cmake" -DCMAKE_BUILD_TYPE=Release \
  -DPython_EXECUTABLE="$PWD/$PY" -DPython_INCLUDE_DIR="$PWD/$inc/python$pyver" -DCMAKE_CXX_FLAGS="-isystem $PWD/$inc" \
  -DPAGED_BUILD_CUDA=OFF -DPAGED_STATIC_DRIVERS=ON -DPAGED_OPENMP=OFF >/dev/null
cmake --build "$pool" -j"$(nproc)" --target parallel_driver kernel_attention_driver 2>&1 | { grep -E "warning|error" || true; }
stamp "built the no-OpenMP drivers"
for driver in parallel_driver kernel_attention_driver; do
  t0=$(date +%s)
  qemu-aarch64 -cpu max "$pool/csrc_cpu/$driver"
  stamp "$driver (std::thread pool) on -cpu max passed in $(( $(date +%s) - t0 )) s"
done
stamp "all aarch64 checks passed"
