"""16-byte alignment at the CUDA boundary, checked without a GPU.

Every CUDA kernel moves rows as 16-byte vectors; a contiguous view that
starts off a 16-byte boundary (``flat[1:].view(...)``) would be a
misaligned-address fault on the device, which poisons the whole CUDA
context. The bindings check every array's data pointer first, before any
other check and any launch (csrc_cuda/alignment.h): a ValueError naming the
array. Here: the rule itself, through a g++ driver over the host-only
header, and the compiled module's boundary on misaligned CPU views (the
alignment is reported before the device type is even looked at)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from test_cuda_backend import _ops  # the one way these tests reach _C_cuda (skip or fail by nvcc)

HEADER_DIR = Path(__file__).resolve().parents[1] / "csrc_cuda"

DRIVER = r"""
#include <cstdio>
#include <cstring>
#include "alignment.h"
using namespace paged::cuda;
int main() {
  alignas(64) static unsigned char buf[128];
  int bad = 0;
  auto expect = [&](bool ok, const char* what) { if (!ok) { std::printf("FAIL %s\n", what); ++bad; } };
  expect(misalignment(buf, 16) == 0, "aligned base");
  expect(misalignment(buf + 2, 16) == 2, "a half view one element in");
  expect(misalignment(buf + 16, 16) == 0, "a row of 16 bytes in");
  expect(misalignment(buf + 4, 4) == 0, "an int32 element");
  expect(misalignment(buf + 4, 8) == 4, "an int64 view 4 bytes in");
  expect(required_alignment(true, 2) == 16 && required_alignment(false, 8) == 8, "required alignment");
  expect(alignment_expected(16).find("16-byte vectors") != std::string::npos, "message");
  expect(alignment_got(2).find("2 bytes past") != std::string::npos, "message got");
  std::printf("%d failures\n", bad);
  return bad != 0;
}
"""


@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++")
def test_alignment_rule_in_the_host_header(tmp_path):
    src = tmp_path / "driver.cpp"
    src.write_text(DRIVER)
    exe = tmp_path / "driver"
    build = subprocess.run(["g++", "-std=c++17", "-Wall", "-Wextra", "-Werror", f"-I{HEADER_DIR}", str(src),
                            "-o", str(exe)], capture_output=True, text=True, timeout=120)
    assert build.returncode == 0, build.stderr
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=30)
    assert run.returncode == 0 and run.stdout.strip() == "0 failures", run.stdout


def _misaligned(*shape, dtype=torch.float16, by: int = 1):
    """A contiguous view ``by`` elements into a fresh buffer."""
    n = 1
    for s in shape:
        n *= s
    flat = torch.zeros(n + by, dtype=dtype)
    view = flat[by:].view(*shape)
    assert view.is_contiguous() and view.data_ptr() % 16 == by * flat.element_size()
    return view


def test_misaligned_views_are_value_errors_before_any_kernel():
    ops = _ops()
    kc = torch.zeros(4, 2, 16, 64, dtype=torch.float16)
    key = torch.zeros(3, 2, 64, dtype=torch.float16)
    slots = torch.zeros(3, dtype=torch.int64)
    msg = r"{}: expected a data pointer aligned to 16 bytes \(the kernels read 16-byte vectors\), got an address \d+ " \
          r"bytes past one"
    with pytest.raises(ValueError, match=msg.format("key").replace(r"\d+", "2")):
        ops.reshape_and_cache(_misaligned(3, 2, 64), key, kc, kc, slots, 0)
    with pytest.raises(ValueError, match=msg.format("value_cache")):
        ops.reshape_and_cache(key, key, kc, _misaligned(4, 2, 16, 64), slots, 0)
    q = torch.zeros(2, 4, 64, dtype=torch.float16)
    tables, lens = torch.zeros(2, 1, dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    ws = torch.zeros(0, 0, 0, 0)
    with pytest.raises(ValueError, match=msg.format("query")):
        ops.paged_attention(q, _misaligned(2, 4, 64), kc, kc, tables, lens, 1.0, 0, ws, ws, 1, 0)
    with pytest.raises(ValueError, match=msg.format("out")):
        ops.prefill_attention(_misaligned(2, 4, 64, dtype=torch.bfloat16, by=4), q, kc, kc,
                              torch.tensor([0, 1, 2], dtype=torch.int32), lens, tables, 1, 1.0, 0, 0)
    with pytest.raises(ValueError, match=msg.format(r"key_caches\[i\]")):
        ops.copy_blocks([_misaligned(4, 2, 16, 64)], [kc], torch.zeros(1, 2, dtype=torch.int64), 0)
    # aligned everywhere: the next check (the device) speaks
    with pytest.raises(ValueError, match=r"key_cache: expected a CUDA tensor"):
        ops.reshape_and_cache(key, key, kc, kc, slots, 0)
