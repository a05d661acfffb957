"""The CUDA platform: NVIDIA GPUs through torch.cuda and paged._C_cuda.

Nothing here touches CUDA at import time; detection goes through torch.cuda
when asked. KV cache sizing follows --gpu-memory-utilization per engine
instance (backends/accelerator/memory.py, docs/cuda.md):

    at init:  the device's baseline, and U x total must be free
    budget  = U x total - what this instance uses at its profiled peak

The profiling step itself is the CudaWorker's (backends/cuda/worker.py);
the arithmetic is pure and tested on the CPU.
"""

from __future__ import annotations

import logging
from typing import Any

from paged.backends.accelerator.memory import (DeviceMemory, InstanceMemory, kv_budget_line,  # noqa: F401
                                               kv_cache_budget)
from paged.platforms.base import Availability, MemoryInfo, Platform
from paged.platforms.sizes import format_size

log = logging.getLogger(__name__)


class CudaPlatform(InstanceMemory, Platform):
    name = "cuda"
    device_type = "cuda"
    dist_backend = "nccl"
    auto_priority = 30
    default_block_size = 16

    def __init__(self) -> None:
        self._device_index = 0
        self.utilization = 0.9  # --gpu-memory-utilization (EngineConfig's, through init())

    @property
    def gpu_memory_utilization(self) -> float:
        return self.utilization

    # -- detection ---------------------------------------------------------
    def is_available(self) -> Availability:
        try:
            import torch
        except ImportError as e:
            return Availability(False, f"torch is not installed ({e}); install a CUDA build of torch")
        if not torch.cuda.is_available():
            if torch.version.cuda is None:
                why = f"torch {torch.__version__} built for CPU; install a CUDA build of torch"
            else:
                why = (f"torch {torch.__version__} built for CUDA {torch.version.cuda}, but no driver or GPU "
                       "is visible (check nvidia-smi and CUDA_VISIBLE_DEVICES)")
            return Availability(False, f"no CUDA device visible (torch.cuda.is_available() is False: {why})")
        try:
            import paged._C_cuda  # noqa: F401
        except ImportError as e:
            return Availability(False, f"paged._C_cuda is not compiled ({e}); reinstall paged with nvcc on PATH")
        return Availability(True)

    def device_count(self) -> int:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0

    # -- lifecycle ---------------------------------------------------------
    def init(self, device: int | None = None, gpu_memory_utilization: float | None = None,
             **options: Any) -> None:
        if device is not None:
            self.set_device(int(device))
        # this instance's share must be free now, before the model loads (InstanceMemory)
        self.start_accounting(gpu_memory_utilization)

    def set_device(self, index: int) -> None:
        import torch

        count = self.device_count()
        if not 0 <= index < count:
            raise ValueError(f"cuda device index {index} is out of range ({count} visible)")
        torch.cuda.set_device(index)
        self._device_index = index

    def synchronize(self) -> None:
        import torch

        torch.cuda.synchronize(self._device_index)

    # -- memory and dtypes -------------------------------------------------
    def memory_info(self) -> MemoryInfo:
        import torch

        free, total = torch.cuda.mem_get_info(self._device_index)
        return MemoryInfo(total_bytes=int(total), available_bytes=int(free))

    def device_memory(self) -> DeviceMemory:
        import torch

        return DeviceMemory(torch.cuda, self._device_index)

    def supported_dtypes(self) -> list:
        import torch

        major, _ = torch.cuda.get_device_capability(self._device_index)
        bf16 = [torch.bfloat16] if major >= 8 else []
        return [*bf16, torch.float16, torch.float32]

    def capabilities(self):
        """Head sizes: exactly the kernels' instantiated set
        (backends/cuda SUPPORTED_HEAD_SIZES), so the engine refuses any other
        at start. Batch invariance: decode (split-K by each sequence's own
        length) and prefill (tiles within one sequence) in every dtype; not
        the engine path, whose GEMMs cuBLAS may run differently per batch size."""
        from paged.backends.cuda.attention import SUPPORTED_HEAD_SIZES
        from paged.platforms.capabilities import Capabilities, dtype_name

        dtypes = tuple(self.supported_dtypes())
        return Capabilities(dtypes=dtypes, head_sizes=SUPPORTED_HEAD_SIZES,
                            batch_invariant={dtype_name(d): ("decode", "prefill") for d in dtypes})

    # -- kernels -----------------------------------------------------------
    def worker_cls(self):
        from paged.backends.cuda.worker import CudaWorker

        return CudaWorker

    def ops_module(self):
        try:
            from paged import _C_cuda
        except ImportError:
            return None
        return _C_cuda

    # -- reporting ---------------------------------------------------------
    def env_report(self) -> dict:
        report = super().env_report()
        ops = self.ops_module()
        report["compiled"] = {"_C_cuda": ops is not None, "archs": getattr(ops, "built_archs", "")}
        try:
            import torch
        except ImportError:
            return report
        report["torch"] = torch.__version__
        report["torch_cuda"] = torch.version.cuda
        devices = []
        if report["available"]:
            for i in range(torch.cuda.device_count()):
                p = torch.cuda.get_device_properties(i)
                free, total = torch.cuda.mem_get_info(i)
                devices.append({"index": i, "name": p.name, "capability": f"{p.major}.{p.minor}",
                                "multiprocessors": p.multi_processor_count,
                                "memory_total": format_size(total), "memory_free": format_size(free)})
        report["devices"] = devices
        return report
