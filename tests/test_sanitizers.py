"""The C++ drivers built with ASan+UBSan in one build dir (cached across
runs under the pytest cache) and run with zero sanitizer findings: the block
pool driver (the block accounting's checks, misuse paths and threaded
stress) in every run, and the attention driver (every attention build
against the scalar one, and mixed-bf16's AMX prompt attention where the CPU
has it) and the linear driver (every quantized-linear build, s16's packed
codes included, against the scalar one) as a slow stage: building every kernel with the sanitizers takes
minutes on two cores, so .ci/run runs it after the README's command with
PAGED_SANITIZE_KERNELS=1."""

import os
import subprocess

import pytest

from cmake_build import build_dir, build_targets

SLOW = os.environ.get("PAGED_SANITIZE_KERNELS") == "1"


def run_sanitized(request, name: str) -> None:
    build = build_dir(request, "sanitize")
    build_targets(build, [name], {"PAGED_BUILD_CUDA": "OFF", "PAGED_SANITIZE": "ON", "CMAKE_BUILD_TYPE": "Debug"})
    driver = next(p for p in (build / "csrc_cpu" / name, build / name) if p.exists())
    env = dict(os.environ, ASAN_OPTIONS="detect_leaks=1:abort_on_error=0", UBSAN_OPTIONS="print_stacktrace=1")
    r = subprocess.run([str(driver)], capture_output=True, text=True, timeout=600, env=env)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "ERROR: AddressSanitizer" not in out and "runtime error:" not in out, out
    assert "all checks passed" in out


def test_block_pool_driver_under_asan_ubsan(request):
    run_sanitized(request, "block_pool_driver")


@pytest.mark.skipif(not SLOW, reason="slow stage: .ci/run runs it with PAGED_SANITIZE_KERNELS=1")
def test_attention_driver_under_asan_ubsan(request):
    run_sanitized(request, "kernel_attention_driver")


@pytest.mark.skipif(not SLOW, reason="slow stage: .ci/run runs it with PAGED_SANITIZE_KERNELS=1")
def test_linear_driver_under_asan_ubsan(request):
    run_sanitized(request, "kernel_linear_driver")
