"""Configure and build targets of this repository's CMake project in a
private build dir (cached under the pytest cache), for tests that compile
C++ outside the package build: sanitizer drivers, the Ascend host code."""

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def build_dir(request, name: str) -> Path:
    cache = getattr(request.config, "cache", None)
    if cache is not None:
        return Path(cache.mkdir(name))
    # without pytest's cache (-p no:cacheprovider): one dir per checkout, so
    # two clones on a machine never share a CMake cache
    tag = hashlib.sha1(str(ROOT).encode()).hexdigest()[:8]
    return Path(os.environ.get("TMPDIR", "/tmp")) / f"paged-{name}-{tag}"


def build_targets(build: Path, targets: list[str], defines: dict[str, str]) -> str:
    """cmake configure + build; asserts success and a warning-free log.
    Skips (with the reason) where cmake or a C++ compiler is missing."""
    if shutil.which("cmake") is None:
        pytest.skip("cmake not found: cannot build the C++ sources")
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler found (set CXX)")
    configure = ["cmake", "-S", str(ROOT), "-B", str(build), f"-DPython_EXECUTABLE={sys.executable}"]
    configure += [f"-D{k}={v}" for k, v in defines.items()]
    log = ""
    for cmd in (configure, ["cmake", "--build", str(build), "--target", *targets]):
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        log += r.stdout + r.stderr
        assert r.returncode == 0, f"{' '.join(cmd)} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
        assert "warning:" not in r.stdout + r.stderr, r.stdout + r.stderr
    return log
