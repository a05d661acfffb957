"""Ascend NPU platform (910B) through torch_npu and CANN.

torch_npu is imported only when this platform is actually used: with
torch-npu installed but no CANN, importing it fails (and, with torch's
device-backend autoload on, so would ``import torch``), so detection first
checks the pieces without importing, and says exactly what is missing.

KV sizing is per engine instance, from a profiled worst-case step, like
CUDA's (backends/accelerator/memory.py): --gpu-memory-utilization is this
instance's share of the NPU's memory.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os

from paged.backends.accelerator.memory import DeviceMemory, InstanceMemory
from paged.platforms.base import Availability, MemoryInfo, Platform, PlatformUnavailable

# torch_npu registers itself for torch's device-backend autoload; without CANN
# that makes `import torch` fail. Off unless the user asked for it.
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

TORCH_NPU_PIN = "torch-npu==2.13.0"
CANN_SET_ENV = "/usr/local/Ascend/ascend-toolkit/set_env.sh"
ACL_LIBRARY = "libascendcl.so"
#: the CANN operators NpuBackend needs (backends/npu); npu_scatter_pa_kv_cache
#: is used where the release has it (an index copy otherwise, operators.py)
OPERATORS = ("npu_fused_infer_attention_score",)


def torch_npu_installed() -> bool:
    return importlib.util.find_spec("torch_npu") is not None


def cann_library_error() -> str | None:
    """None when libascendcl.so loads, else the loader's message."""
    try:
        ctypes.CDLL(ACL_LIBRARY)
    except OSError as e:
        return str(e)
    return None


def _import_torch_npu():
    import torch
    import torch_npu  # noqa: F401

    return torch


class NpuPlatform(InstanceMemory, Platform):
    name = "npu"
    device_type = "npu"
    dist_backend = "hccl"
    auto_priority = 20
    # npu_fused_infer_attention_score needs a multiple of 128 for paged
    # prefill (and prefix caching hits), so 128 is the only safe default.
    default_block_size = 128

    def is_available(self) -> Availability:
        if not torch_npu_installed():
            return Availability(False, f"torch_npu is not installed: pip install {TORCH_NPU_PIN}")
        err = cann_library_error()
        if err is not None:
            return Availability(False, f"CANN not found ({ACL_LIBRARY}: {err}): source {CANN_SET_ENV}")
        try:
            torch = _import_torch_npu()
        except Exception as e:  # torch_npu present but broken (version mismatch, missing CANN pieces)
            return Availability(False, f"import torch_npu failed: {e}; check {TORCH_NPU_PIN} and source {CANN_SET_ENV}")
        problem = self.runtime_problem(torch)
        return Availability(problem is None, problem or "")

    def runtime_problem(self, torch) -> str | None:
        """With torch_npu imported: what the engine would still miss (the
        operators NpuBackend calls, a visible device), or None. Checked at
        detection, before any model is loaded."""
        import sys

        from paged.backends.npu import operators

        module = sys.modules["torch_npu"]
        missing = [op for op in OPERATORS if not hasattr(module, op)]
        if missing:
            version = getattr(module, "__version__", "?")
            return f"torch_npu {version} lacks {', '.join(missing)}: pip install {TORCH_NPU_PIN}"
        try:
            operators.plan(module)  # the keywords NpuBackend will pass, read from this release
        except ValueError as e:
            return f"{e}: pip install {TORCH_NPU_PIN}"
        if torch.npu.device_count() == 0:
            visible = os.environ.get("ASCEND_RT_VISIBLE_DEVICES")
            hint = f" (ASCEND_RT_VISIBLE_DEVICES={visible})" if visible is not None else ""
            return f"no Ascend NPU visible{hint}: check npu-smi info"
        return None

    def _require(self):
        a = self.is_available()
        if not a.ok:
            raise PlatformUnavailable(a.reason)
        return _import_torch_npu()

    def device_count(self) -> int:
        if not torch_npu_installed() or cann_library_error() is not None:
            return 0
        try:
            return int(_import_torch_npu().npu.device_count())
        except Exception:
            return 0

    def init(self, rank: int = 0, gpu_memory_utilization: float | None = None, **options) -> None:
        """This rank's NPU becomes the current device before any tensor is
        made; its memory baseline is read and this instance's share checked."""
        self.set_device(rank)
        self._device_index = int(rank)
        self.start_accounting(gpu_memory_utilization)

    _device_index = 0

    def device_memory(self) -> DeviceMemory:
        return DeviceMemory(self._require().npu, self._device_index)

    def set_device(self, index: int) -> None:
        self._require().npu.set_device(index)

    def synchronize(self) -> None:
        self._require().npu.synchronize()

    def memory_info(self) -> MemoryInfo:
        free, total = self._require().npu.mem_get_info(self._device_index)
        return MemoryInfo(total_bytes=int(total), available_bytes=int(free))

    def supported_dtypes(self) -> list:
        from paged.backends.npu import layout

        return list(layout.SUPPORTED_DTYPES)

    def capabilities(self):
        """The CANN operators' limits (backends/npu/layout.py, one source with
        NpuBackend's own checks); no batch invariance: the fused operator
        does not promise one split of the work for every batch."""
        from paged.backends.npu import layout
        from paged.platforms.capabilities import Capabilities

        return Capabilities(dtypes=layout.SUPPORTED_DTYPES, block_size_multiple=layout.BLOCK_SIZE_MULTIPLE,
                            max_block_size=layout.MAX_BLOCK_SIZE, head_size_multiple=layout.HEAD_SIZE_ALIGN,
                            max_head_size=layout.MAX_HEAD_SIZE, batch_invariant={})

    def worker_cls(self):
        from paged.backends.npu.worker import NpuWorker

        return NpuWorker

    def env_report(self) -> dict:
        report = super().env_report()
        report.update({
            "torch_npu_installed": torch_npu_installed(),
            "cann_library": cann_library_error() or "ok",
            "ASCEND_RT_VISIBLE_DEVICES": os.environ.get("ASCEND_RT_VISIBLE_DEVICES"),
            "ASCEND_HOME_PATH": os.environ.get("ASCEND_HOME_PATH"),
            "TORCH_DEVICE_BACKEND_AUTOLOAD": os.environ.get("TORCH_DEVICE_BACKEND_AUTOLOAD"),
            "dist_backend": self.dist_backend,
            "default_block_size": self.default_block_size,
        })
        if report["available"]:
            import sys

            from paged.backends.npu import operators

            torch = _import_torch_npu()
            report["operators"] = operators.plan(sys.modules["torch_npu"]).describe()
            report["device_count"] = int(torch.npu.device_count())
            report["devices"] = [torch.npu.get_device_name(i) for i in range(report["device_count"])]
            mem = self.memory_info()
            report["memory_total_gib"] = round(mem.total_bytes / 2**30, 2)
            report["memory_available_gib"] = round(mem.available_bytes / 2**30, 2)
        return report
