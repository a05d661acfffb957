"""The CUDA platform: NVIDIA GPUs through torch.cuda and paged._C_cuda.

Nothing here touches CUDA at import time; detection goes through torch.cuda
when asked. KV cache sizing follows --gpu-memory-utilization (docs/cuda.md):

    budget = utilization * total - memory used at the peak of a profiled worst-case step

The profiling step itself is the CudaWorker's (backends/cuda/worker.py); the
arithmetic here is pure (kv_cache_budget, device_used_bytes) and tested on
the CPU.
"""

from __future__ import annotations

import logging
from typing import Any

from paged.platforms.base import Availability, MemoryInfo, Platform
from paged.platforms.sizes import format_size

log = logging.getLogger(__name__)


def kv_cache_budget(total_bytes: int, used_bytes: int, utilization: float = 0.9,
                    requested: int | None = None) -> int:
    """Bytes the KV cache may take on one GPU: ``utilization * total - used``,
    where ``used`` is the device memory in use after profiling the model at
    the max batch (weights, activations, CUDA context, other processes).
    ``requested`` (``--kv-cache-memory``) is honoured when it fits that
    budget. Raises ValueError with the numbers when nothing fits."""
    if not isinstance(utilization, (int, float)) or not 0.0 < float(utilization) <= 1.0:
        raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {utilization!r}")
    if used_bytes < 0 or total_bytes <= 0:
        raise ValueError(f"invalid memory figures: total {total_bytes} bytes, used {used_bytes} bytes")
    allowed = int(float(utilization) * total_bytes)
    budget = allowed - int(used_bytes)
    if budget <= 0:
        raise ValueError(
            f"--gpu-memory-utilization {utilization:.2f} allows {format_size(allowed)} of the GPU's "
            f"{format_size(total_bytes)}, but {format_size(used_bytes)} are already used after profiling "
            f"the model: no room for the KV cache (raise --gpu-memory-utilization, lower the max batch / "
            f"model length, or use a smaller model)")
    if requested is None:
        return budget
    if requested < 0 or requested > budget:
        raise ValueError(
            f"--kv-cache-memory {format_size(requested)} exceeds the {format_size(budget)} left for the KV "
            f"cache (--gpu-memory-utilization {utilization:.2f} of {format_size(total_bytes)}, "
            f"{format_size(used_bytes)} used after profiling)")
    return int(requested)


def device_used_bytes(total_bytes: int, free_bytes: int, reserved_bytes: int, peak_allocated_bytes: int) -> int:
    """Device memory in use at a profiled peak: torch's peak allocation
    (weights + activations) plus what lives outside torch's allocator (the
    CUDA context, cuBLAS workspaces, other processes), i.e. the device's used
    memory minus what torch's caching allocator holds."""
    non_torch = max(0, (int(total_bytes) - int(free_bytes)) - int(reserved_bytes))
    return int(peak_allocated_bytes) + non_torch


def kv_budget_line(total_bytes: int, used_bytes: int, utilization: float, budget_bytes: int) -> str:
    """The sizing logged once: what the flag allows, what the profile used, what is left."""
    return (f"KV cache budget: --gpu-memory-utilization {utilization:.2f} x {format_size(total_bytes)} = "
            f"{format_size(int(utilization * total_bytes))}, {format_size(used_bytes)} used at the profiled "
            f"peak -> {format_size(budget_bytes)} for the KV cache")


class CudaPlatform(Platform):
    name = "cuda"
    device_type = "cuda"
    dist_backend = "nccl"
    auto_priority = 30
    default_block_size = 16

    def __init__(self) -> None:
        self._device_index = 0
        self.gpu_memory_utilization = 0.9  # EngineConfig's, through init()

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
        if gpu_memory_utilization is not None:
            self.gpu_memory_utilization = float(gpu_memory_utilization)

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

    def used_after_profiling_bytes(self) -> int:
        """Device memory the model needs at its peak (device_used_bytes):
        torch's peak allocation since the last
        ``torch.cuda.reset_peak_memory_stats()`` plus what is used outside
        torch's allocator. The CudaWorker calls it after its profiling step."""
        import torch

        free, total = torch.cuda.mem_get_info(self._device_index)
        return device_used_bytes(total, free, torch.cuda.memory_reserved(self._device_index),
                                 torch.cuda.max_memory_allocated(self._device_index))

    def kv_cache_budget_bytes(self, requested: int | None = None, profiled_peak_bytes: int | None = None,
                              utilization: float | None = None) -> int:
        """See kv_cache_budget(); ``profiled_peak_bytes`` (the Worker's
        profiling, core/engine/worker.py) defaults to used_after_profiling_bytes(),
        ``utilization`` to --gpu-memory-utilization. Logs the numbers."""
        used = self.used_after_profiling_bytes() if profiled_peak_bytes is None else int(profiled_peak_bytes)
        utilization = self.gpu_memory_utilization if utilization is None else utilization
        total = self.memory_info().total_bytes
        budget = kv_cache_budget(total, used, utilization, requested)
        log.info(kv_budget_line(total, used, utilization, budget))
        return budget

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
