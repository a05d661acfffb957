"""The C++ drivers built with ASan+UBSan in one build dir (cached across
runs under the pytest cache) and run: the block pool driver (the block
accounting's checks, misuse paths and threaded stress) and the attention
driver (every attention build against the scalar one, and mixed-bf16's AMX
prompt attention where the CPU has it), with zero sanitizer findings."""

import os
import subprocess

from cmake_build import build_dir, build_targets


import pytest

DRIVERS = ["block_pool_driver", "kernel_attention_driver"]


@pytest.fixture(scope="module")
def sanitized(request):
    build = build_dir(request, "sanitize")
    build_targets(build, DRIVERS, {"PAGED_BUILD_CUDA": "OFF", "PAGED_SANITIZE": "ON", "CMAKE_BUILD_TYPE": "Debug"})
    return build


@pytest.mark.parametrize("name", DRIVERS)
def test_driver_under_asan_ubsan(sanitized, name):
    driver = next(p for p in (sanitized / "csrc_cpu" / name, sanitized / name) if p.exists())
    env = dict(os.environ, ASAN_OPTIONS="detect_leaks=1:abort_on_error=0", UBSAN_OPTIONS="print_stacktrace=1")
    r = subprocess.run([str(driver)], capture_output=True, text=True, timeout=300, env=env)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "ERROR: AddressSanitizer" not in out and "runtime error:" not in out, out
    assert "all checks passed" in out
