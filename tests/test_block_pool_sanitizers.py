"""Builds csrc_cpu/tests/block_pool_driver.cpp with ASan+UBSan in its own
build dir (cached across runs under the pytest cache) and runs it: the C++
block accounting must pass its checks, misuse paths and threaded stress with
zero sanitizer findings."""

import os
import subprocess

from cmake_build import build_dir, build_targets


def test_block_pool_driver_under_asan_ubsan(request):
    build = build_dir(request, "block_pool_sanitize")
    build_targets(build, ["block_pool_driver"],
                  {"PAGED_BUILD_CUDA": "OFF", "PAGED_SANITIZE": "ON", "CMAKE_BUILD_TYPE": "Debug"})
    driver = next(p for p in (build / "csrc_cpu" / "block_pool_driver", build / "block_pool_driver") if p.exists())
    env = dict(os.environ, ASAN_OPTIONS="detect_leaks=1:abort_on_error=0", UBSAN_OPTIONS="print_stacktrace=1")
    r = subprocess.run([str(driver)], capture_output=True, text=True, timeout=120, env=env)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "ERROR: AddressSanitizer" not in out and "runtime error:" not in out, out
    assert "all checks passed" in out
