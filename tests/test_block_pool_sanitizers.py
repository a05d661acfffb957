"""Builds csrc_cpu/tests/block_pool_driver.cpp with ASan+UBSan in its own
build dir (cached across runs under the pytest cache) and runs it: the C++
block accounting must pass its checks, misuse paths and threaded stress with
zero sanitizer findings."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _build_dir(request) -> Path:
    cache = getattr(request.config, "cache", None)
    if cache is not None:
        return Path(cache.mkdir("block_pool_sanitize"))
    return Path(os.environ.get("TMPDIR", "/tmp")) / "paged-block-pool-sanitize"


def test_block_pool_driver_under_asan_ubsan(request):
    if shutil.which("cmake") is None:
        pytest.skip("cmake not found: cannot build the C++ block pool driver")
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler found (set CXX)")
    build = _build_dir(request)
    configure = ["cmake", "-S", str(ROOT), "-B", str(build), "-DPAGED_BUILD_CUDA=OFF", "-DPAGED_SANITIZE=ON",
                 "-DCMAKE_BUILD_TYPE=Debug", f"-DPython_EXECUTABLE={sys.executable}"]
    for cmd in (configure, ["cmake", "--build", str(build), "--target", "block_pool_driver"]):
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, f"{' '.join(cmd)} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
        assert "warning:" not in r.stdout + r.stderr, r.stdout + r.stderr
    driver = next(p for p in (build / "csrc_cpu" / "block_pool_driver", build / "block_pool_driver") if p.exists())
    env = dict(os.environ, ASAN_OPTIONS="detect_leaks=1:abort_on_error=0", UBSAN_OPTIONS="print_stacktrace=1")
    r = subprocess.run([str(driver)], capture_output=True, text=True, timeout=120, env=env)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "ERROR: AddressSanitizer" not in out and "runtime error:" not in out, out
    assert "all checks passed" in out
