"""CI compiles the Ascend host code (csrc_ascend) against torch-npu's bundled
ACL headers with warnings as errors, without CANN and without installing
torch-npu (installed without CANN it breaks `import torch`): the fetch
script unpacks the torch-npu wheel into the user cache and CMake builds the
_C_ascend target in a private build dir."""

import subprocess
from pathlib import Path

import pytest

from cmake_build import ROOT, build_dir, build_targets


def _fetch_headers() -> Path:
    r = subprocess.run(["sh", str(ROOT / "csrc_ascend" / "fetch_torch_npu_headers.sh")],
                       capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        pytest.skip(f"torch-npu wheel could not be fetched (offline?): {r.stderr.strip()[-300:]}")
    return Path(r.stdout.strip().splitlines()[-1])


def test_csrc_ascend_compiles_against_torch_npu_headers(request):
    include = _fetch_headers() / "torch_npu" / "include"
    assert (include / "acl" / "acl_rt.h").exists(), include
    build = build_dir(request, "ascend_build")
    log = build_targets(build, ["_C_ascend"],
                        {"PAGED_BUILD_CUDA": "OFF", "PAGED_TORCH_NPU_INCLUDE": str(include)})
    built = list((build / "csrc_ascend").glob("_C_ascend*.so"))
    assert built, "the _C_ascend module was not produced"
