"""Device memory per engine instance, for the accelerators (CUDA, NPU).

``--gpu-memory-utilization U`` is THIS instance's share of the device (as in
vLLM): two engines at 0.45 each fit on one device. Memory other processes
hold is not charged to this instance; instead the device must have ``U x
total`` free when the instance starts (checked at ``init``, before the model
loads), which is what guarantees that the shares fit side by side.

    baseline = the device's memory when this instance selected it (before loading)
    used     = torch's peak allocation since then (weights + the profiled step's activations)
             + growth of memory outside torch's allocator since then (cuBLAS / ACL workspaces,
               graph executables)
             + what stays allocated beside the KV cache for the whole run and is
               not in that peak (CUDA graph pool and static buffers, split-K workspaces)
    budget   = U x total - used                               (the KV cache)

The arithmetic is pure and tested on the CPU (tests/test_cuda_sizing.py);
``DeviceMemory`` reads the figures through a torch device module
(torch.cuda, or torch.npu once torch_npu is imported), whose memory API is
the same for both.
"""

from __future__ import annotations

from dataclasses import dataclass

from paged.platforms.sizes import format_size

#: the option every accelerator reads (EngineConfig.gpu_memory_utilization)
FLAG = "--gpu-memory-utilization"


@dataclass(frozen=True)
class MemorySnapshot:
    """One reading of a device: its total and free bytes and what torch's
    caching allocator holds (reserved) and hands out (allocated)."""

    total: int
    free: int
    reserved: int = 0
    allocated: int = 0

    @property
    def outside_torch(self) -> int:
        """Bytes in use that torch's allocator does not hold: runtime
        contexts, library workspaces, other processes."""
        return max(0, self.total - self.free - self.reserved)


def check_share_fits(total: int, free_at_start: int, utilization: float) -> None:
    """The instance's share must be free when it starts (ValueError, one
    line, otherwise): shares of several instances then fit together."""
    check_utilization(utilization)
    share = int(float(utilization) * total)
    if free_at_start < share:
        raise ValueError(
            f"{FLAG} {utilization:.2f}: expected the {format_size(share)} share of the device's "
            f"{format_size(total)} to be free at start (others hold {format_size(total - free_at_start)}; "
            f"lower {FLAG}), got {format_size(free_at_start)} free")


def check_utilization(utilization) -> None:
    if isinstance(utilization, bool) or not isinstance(utilization, (int, float)) \
            or not 0.0 < float(utilization) <= 1.0:
        raise ValueError(f"{FLAG} must be in (0, 1], got {utilization!r}")


def instance_used_bytes(baseline: MemorySnapshot, now: MemorySnapshot, peak_allocated: int,
                        held_bytes: int = 0) -> int:
    """What this instance uses at its profiled peak (see the module doc):
    torch's peak allocation, the growth of memory outside torch since the
    baseline (never what others held before), and ``held_bytes``."""
    grown_outside = max(0, now.outside_torch - baseline.outside_torch)
    return int(peak_allocated) + grown_outside + int(held_bytes)


def kv_cache_budget(total_bytes: int, used_bytes: int, utilization: float = 0.9,
                    requested: int | None = None) -> int:
    """Bytes the KV cache may take: ``utilization * total - used``, ``used``
    being this instance's (instance_used_bytes). ``requested``
    (``--kv-cache-memory``) is honoured when it fits. ValueError with the
    numbers when nothing fits."""
    check_utilization(utilization)
    if used_bytes < 0 or total_bytes <= 0:
        raise ValueError(f"invalid memory figures: total {total_bytes} bytes, used {used_bytes} bytes")
    allowed = int(float(utilization) * total_bytes)
    budget = allowed - int(used_bytes)
    if budget <= 0:
        raise ValueError(
            f"{FLAG} {utilization:.2f} allows {format_size(allowed)} of the device's "
            f"{format_size(total_bytes)}, but this instance already uses {format_size(used_bytes)} after "
            f"profiling the model: no room for the KV cache (raise {FLAG}, lower the max batch / "
            f"model length, or use a smaller model)")
    if requested is None:
        return budget
    if requested < 0 or requested > budget:
        raise ValueError(
            f"--kv-cache-memory {format_size(requested)} exceeds the {format_size(budget)} left for the KV "
            f"cache ({FLAG} {utilization:.2f} of {format_size(total_bytes)}, "
            f"{format_size(used_bytes)} used by this instance after profiling)")
    return int(requested)


def kv_budget_line(total_bytes: int, used_bytes: int, utilization: float, budget_bytes: int) -> str:
    """The sizing logged once: this instance's share, its use at the profiled peak, what is left."""
    return (f"KV cache budget: {FLAG} {utilization:.2f} x {format_size(total_bytes)} = "
            f"{format_size(int(utilization * total_bytes))}, {format_size(used_bytes)} used at the profiled "
            f"peak -> {format_size(budget_bytes)} for the KV cache")


class DeviceMemory:
    """The memory API of a torch device module (torch.cuda; torch.npu, which
    torch_npu makes the same) for one device index."""

    def __init__(self, module, index: int):
        self.module, self.index = module, int(index)

    def snapshot(self) -> MemorySnapshot:
        free, total = self.module.mem_get_info(self.index)
        return MemorySnapshot(int(total), int(free), int(self.module.memory_reserved(self.index)),
                              int(self.module.memory_allocated(self.index)))

    def settle(self) -> None:
        """Finished work and no cached free blocks: the next reading counts
        only what is really in use."""
        import gc

        gc.collect()
        self.module.synchronize(self.index)
        self.module.empty_cache()

    def reset_peak(self) -> None:
        self.module.reset_peak_memory_stats(self.index)

    def peak_allocated(self) -> int:
        return int(self.module.max_memory_allocated(self.index))


class InstanceMemory:
    """A platform's side of the accounting (CudaPlatform, NpuPlatform): the
    baseline at ``start`` and the budget after the worker's profile."""

    utilization: float = 0.9
    baseline: MemorySnapshot | None = None
    #: whether the device's memory statistics measure anything (the worker
    #: runs its profiling step only then)
    profiles_memory: bool = True

    def device_memory(self) -> DeviceMemory:  # the platform's torch device module and index
        raise NotImplementedError

    def start_accounting(self, utilization: float | None = None) -> None:
        """At init, once the device is selected and before anything loads:
        the baseline, and the check that this instance's share is free."""
        if utilization is not None:
            check_utilization(utilization)
            self.utilization = float(utilization)
        self.baseline = self.device_memory().snapshot()
        check_share_fits(self.baseline.total, self.baseline.free, self.utilization)

    def used_after_profiling_bytes(self, held_bytes: int = 0) -> int:
        """instance_used_bytes from now and the baseline (read now if start_accounting never ran)."""
        mem = self.device_memory()
        now = mem.snapshot()
        return instance_used_bytes(self.baseline or now, now, mem.peak_allocated(), held_bytes)

    def kv_cache_budget_bytes(self, requested: int | None = None, profiled_peak_bytes: int | None = None,
                              utilization: float | None = None) -> int:
        """kv_cache_budget() with this instance's profiled use (the worker's
        profile_peak_bytes; read now when None); logs the numbers."""
        import logging

        used = self.used_after_profiling_bytes() if profiled_peak_bytes is None else int(profiled_peak_bytes)
        utilization = self.utilization if utilization is None else utilization
        total = self.device_memory().snapshot().total
        budget = kv_cache_budget(total, used, utilization, requested)
        logging.getLogger("paged.engine").info(kv_budget_line(total, used, utilization, budget))
        return budget
