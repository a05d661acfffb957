"""The C++ kernel drivers (csrc_cpu/tests/kernel_*_driver.cpp): every SIMD
build of the kernel table (csrc_cpu/kernel_builds.cpp) this CPU runs
against the scalar build on random inputs, the
quantized linear bit for bit, attention within the drivers' stated
tolerance. Oracle: the scalar build, plain C++ written from the contracts in
docs/kernels.md.

One private build (cached under the pytest cache) with OpenMP turned off
(PAGED_OPENMP=OFF, the fallback Apple clang gets without libomp) serves both
checks: the kernels on this CPU, and the C++ checks of the no-OpenMP
configuration: its std::thread pool (parallel_driver; the attention kernel
runs on it too) and the block pool driver. The package's own OpenMP build
runs the same kernels through Python in test_kernels / test_quant_linear.
aarch64 builds run under qemu in CI's emulation stage (.ci/arm_emulation.sh)."""

import subprocess

import pytest

from cmake_build import build_dir, build_targets

DRIVERS = ["kernel_attention_driver", "kernel_linear_driver", "parallel_driver", "block_pool_driver"]


@pytest.fixture(scope="module")
def no_openmp_build(request):
    build = build_dir(request, "cpu_no_openmp")
    log = build_targets(build, DRIVERS, {"PAGED_BUILD_CUDA": "OFF", "PAGED_OPENMP": "OFF",
                                         "CMAKE_BUILD_TYPE": "Release"})
    return build, log


@pytest.mark.slow  # its build is ~3.5 min on two cores: .ci/run's slow stage (tests/conftest.py)
@pytest.mark.parametrize("driver", DRIVERS)
def test_driver_passes_without_openmp(no_openmp_build, driver):
    build, _ = no_openmp_build
    exe = build / "csrc_cpu" / driver
    r = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "all checks passed" in out, out
    if driver != "block_pool_driver":
        assert "threads: std::thread pool (no OpenMP)" in out, out
    if driver.startswith("kernel_"):
        family = driver.split("_")[1]
        assert f"{family}: auto picks" in out, out
    if driver == "kernel_attention_driver":  # the prompt-row families of the table, each run or said not to
        for prompt_family in ("bf16_prompt_attention", "lanes_prompt_attention"):
            assert f"\n{prompt_family} " in out or f"\n{prompt_family}: " in out, out
