"""Ascend NPU pieces that need no device: layout / mask arithmetic, argument
checks, per-step metadata, detection messages, the _C_ascend probe without CANN.
The NPU conformance run itself needs a 910B and is skipped here."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from paged.backends.npu.attention import NpuBackend, layout
from paged.backends.reference.attention import ReferenceBackend
from paged.platforms.npu import NpuPlatform

WHEEL_DIR = Path.home() / ".cache/paged/torch-npu-2.13.0"  # csrc_ascend/fetch_torch_npu_headers.sh
PAGED = Path(sys.executable).with_name("paged")


# ---- layout and masks ---------------------------------------------------------

@pytest.mark.parametrize("kw, needle", [
    (dict(dtype=torch.float32), r"dtype \(npu\): expected one of .*, got torch.float32"),
    (dict(block_size=16), r"block_size \(npu\): expected a multiple of 128 .*, got 16$"),
    (dict(block_size=640), "block_size .*got 640$"), (dict(head_size=72), r"head_size \(npu\): expected .*got 72$"),
    (dict(num_heads=12, num_kv_heads=8), "num_heads / num_kv_heads .*got 12 / 8$"),
    (dict(num_heads=130, num_kv_heads=2), "got 130 / 2$"),
])
def test_unsupported_shapes_are_named(kw, needle):
    args = dict(num_heads=8, num_kv_heads=2, head_size=128, block_size=128, dtype=torch.float16) | kw
    with pytest.raises(ValueError, match=needle):
        NpuBackend(**args, device="cpu")


def test_cache_layout():
    be = NpuBackend(8, 2, 128, 128, torch.bfloat16, "cpu")
    assert be.kv_cache_shape(5) == (5, 128, 2, 128)
    assert be.bytes_per_block(3) == 2 * 3 * 128 * 2 * 128 * 2


def test_pad_unpad_roundtrip():
    q = torch.randn(9, 4, 16)
    lens = [2, 1, 6]
    idx = {k: torch.from_numpy(a) for k, a in layout.padding_indices(lens).items()}  # host arrays
    padded = layout.pad_queries(q, idx["pad_index"], len(lens))
    assert padded.shape == (3, 6, 64)
    assert torch.equal(padded[0, :2], q[:2].reshape(2, 64)) and torch.equal(padded[2], q[3:].reshape(6, 64))
    assert torch.equal(padded[1, 1:], q[2].reshape(1, 64).expand(5, 64))  # padding repeats the last row
    assert torch.equal(layout.unpad_output(padded, idx["unpad_index"], 4), q)


def test_causal_mask_is_made_once_per_device():
    assert layout.causal_mask(torch.device("cpu")) is layout.causal_mask(torch.device("cpu"))


@pytest.mark.parametrize("window", [1, 3, 50])
def test_decode_window_mask_matches_definition(window):
    seq_lens, kv_len = [5, 9, 3], 12
    dec = layout.decode_window_mask(torch.tensor(seq_lens, dtype=torch.int32), kv_len, window)
    assert dec.shape == (3, kv_len)
    for i, sl in enumerate(seq_lens):  # decode: the one query is the last position
        p = sl - 1
        assert dec[i].tolist() == [not (p - window < j <= p) for j in range(kv_len)]


def test_sliding_window_prefill_is_a_band_not_a_dense_mask():
    """The prefill call's window is sparse_mode 4 on the cached 2048 mask
    (pre_tokens = window - 1: keys p - W < j <= p), never a [B, 1, max_q,
    KV_S] mask (8 x 512 x 131072 bools = 512 MiB a step)."""
    from paged.backends.npu.metadata import prefill_extra

    extra = prefill_extra(100, torch.device("cpu"))
    assert extra["sparse_mode"] == 4 and (extra["pre_tokens"], extra["next_tokens"]) == (99, 0)
    assert extra["atten_mask"] is layout.causal_mask(torch.device("cpu"))
    assert prefill_extra(0, torch.device("cpu")) == {"atten_mask": layout.causal_mask(torch.device("cpu")),
                                                     "sparse_mode": 3}


def test_causal_mask_is_strict_upper_triangle():
    m = layout.causal_mask("cpu")
    assert m.shape == (2048, 2048) and not bool(m.diagonal().any()) and bool(m[0, 1]) and not bool(m[1, 0])


# ---- backend pieces that are plain torch ------------------------------------------

def test_read_kv_and_copy_blocks_agree_with_reference():
    """Same tokens in the NPU layout and the reference layout read back equal."""
    args = (4, 2, 16, 128, torch.float16, "cpu")
    npu, ref = NpuBackend(*args), ReferenceBackend(*args)
    ((nk, nv),), ((rk, rv),) = npu.allocate_kv_cache(1, 3), ref.allocate_kv_cache(1, 3)
    slots = torch.tensor([0, 5, 130, 383, 200], dtype=torch.int64)
    k, v = torch.randn(5, 2, 16).half(), torch.randn(5, 2, 16).half()
    ref.reshape_and_cache(k, v, rk, rv, slots)
    nk[slots // 128, slots % 128] = k  # the layout npu_scatter_pa_kv_cache writes
    nv[slots // 128, slots % 128] = v
    mapping = torch.tensor([[1, 0], [2, 1]], dtype=torch.int64)
    npu.copy_blocks([nk], [nv], mapping)
    ref.copy_blocks([rk], [rv], mapping)
    read = torch.arange(-1, 384, 7, dtype=torch.int64)
    for a, b in zip(npu.read_kv(nk, nv, read), ref.read_kv(rk, rv, read)):
        assert torch.equal(a, b)


def test_bad_arguments_fail_before_any_operator():
    be = NpuBackend(4, 2, 16, 128, torch.float16, "cpu")
    ((kc, vc),) = be.allocate_kv_cache(1, 2)
    k = torch.zeros(3, 2, 16, dtype=torch.float16)
    with pytest.raises(IndexError, match=r"slot_mapping\[2\]: expected a slot < 256 .*, got 256$"):
        be.reshape_and_cache(k, k, kc, vc, torch.tensor([0, 1, 256]))
    with pytest.raises(ValueError, match="slot_mapping: expected dtype torch.int64, got torch.int32"):
        be.reshape_and_cache(k, k, kc, vc, torch.tensor([0, 1, 2], dtype=torch.int32))


@pytest.mark.skipif(NpuPlatform().is_available().ok, reason="torch_npu with CANN present")
def test_operators_without_torch_npu_say_so():
    be = NpuBackend(4, 2, 16, 128, torch.float16, "cpu")
    ((kc, vc),) = be.allocate_kv_cache(1, 2)
    k = torch.zeros(1, 2, 16, dtype=torch.float16)
    with pytest.raises(RuntimeError, match="torch_npu"):
        be.reshape_and_cache(k, k, kc, vc, torch.tensor([3]))


# ---- platform detection ------------------------------------------------------------

def test_platform_contract_without_device():
    p = NpuPlatform()
    assert (p.name, p.device_type, p.dist_backend, p.default_block_size) == ("npu", "npu", "hccl", 128)
    assert p.supported_dtypes() == [torch.bfloat16, torch.float16]
    assert p.worker_cls()(p).attention_backend_cls() is NpuBackend
    if not p.is_available().ok:
        assert p.device_count() == 0
        rep = p.env_report()
        assert rep["available"] is False and rep["reason"]


def _run(code_or_cmd, extra_path=None):
    env = dict(os.environ)
    env.pop("TORCH_DEVICE_BACKEND_AUTOLOAD", None)
    if extra_path:
        env["PYTHONPATH"] = os.pathsep.join([str(extra_path), env.get("PYTHONPATH", "")])
    cmd = code_or_cmd if isinstance(code_or_cmd, list) else [sys.executable, "-c", code_or_cmd]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)


@pytest.mark.skipif(NpuPlatform().is_available().ok, reason="an NPU is present")
def test_env_says_what_is_missing():
    proc = _run([str(PAGED), "--device", "npu", "env"], WHEEL_DIR if _wheel_unpacked() else None)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    want = "set_env.sh" if _wheel_unpacked() else "pip install torch-npu==2.13.0"
    assert want in proc.stderr, proc.stderr


def _wheel_unpacked() -> bool:
    return (WHEEL_DIR / "torch_npu/__init__.py").exists()


@pytest.mark.skipif(not _wheel_unpacked(), reason="torch-npu wheel not unpacked (csrc_ascend/fetch_torch_npu_headers.sh)")
def test_torch_npu_without_cann_keeps_torch_importable():
    """With torch-npu importable but no CANN: paged's platform layer keeps
    `import torch` working and names the missing CANN."""
    code = ("import paged.platforms as P, torch; p = P.load_platform_class('npu')(); "
            "a = p.is_available(); print(a.ok, a.reason)")
    proc = _run(code, WHEEL_DIR)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("False") and "source /usr/local/Ascend/ascend-toolkit/set_env.sh" in proc.stdout


# ---- _C_ascend host code ---------------------------------------------------------

def _c_ascend():
    return pytest.importorskip("paged._C_ascend", reason="_C_ascend not built (torch-npu headers not found)")


def test_c_ascend_binds_only_the_acl_probe():
    """No block pool and no device arena: accounting is the host's, memory torch_npu's."""
    m = _c_ascend()
    assert not hasattr(m, "BlockPool") and not hasattr(m, "block_stride")
    err = m.acl_error()
    if not NpuPlatform().is_available().ok:  # no CANN here: a message naming what to install
        assert "libascendcl.so" in err and "set_env.sh" in err, err


def test_npu_conformance():
    p = NpuPlatform()
    a = p.is_available()
    if not a.ok:
        pytest.skip(f"needs an Ascend NPU: {a.reason}")
    from paged.core.conformance import run_suite

    report = run_suite(p, quick=True)
    assert report.passed, report.table()
