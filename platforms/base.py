"""The Platform interface: what a device is and what it can do.

A Platform detects its device (with the reason when it cannot run), reports
its memory, dtypes and capabilities, places processes (threads, device
indices), and says which Worker runs models on it (``worker_cls``); the
Worker (core/engine/worker.py) holds everything else device-specific.
core/ never imports a device library (torch.cuda, torch_npu) itself.
Built-ins: cpu, cuda, npu; third-party platforms register through the
``paged.platforms`` entry-point group (docs/adding-a-platform.md).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any


class PlatformUnavailable(RuntimeError):
    """Raised when a requested platform cannot run here; the message is one
    line saying what is missing and how to get it (the CLI prints it and
    exits 2)."""


@dataclass
class Availability:
    ok: bool
    reason: str = ""  # when not ok: what is missing and how to get it


@dataclass
class MemoryInfo:
    total_bytes: int
    available_bytes: int


class Platform(abc.ABC):
    """One kind of device. Instances are cheap; construction must not
    initialise a device runtime (that happens in ``init()``)."""

    #: short name used on the command line: cpu, cuda, npu, or a plugin's name
    name: str = ""
    #: torch device type string ("cpu", "cuda", "npu", ...)
    device_type: str = ""
    #: collective backend for torch.distributed (gloo, nccl, hccl)
    dist_backend: str = "gloo"
    #: default KV block size in tokens
    default_block_size: int = 16
    #: built-ins only: "auto" tries the highest first (cuda 30 > npu 20 > cpu 10);
    #: 0 = used only when named (every plugin: auto never picks a third party)
    auto_priority: int = 0

    # -- detection ---------------------------------------------------------
    @abc.abstractmethod
    def is_available(self) -> Availability:
        """Whether this platform can run here, and if not, why."""

    @abc.abstractmethod
    def device_count(self) -> int: ...

    # -- lifecycle ---------------------------------------------------------
    def init(self, **options: Any) -> None:
        """Prepare the platform for serving (bind threads, pick device...).
        Called once by the engine after the platform is chosen."""

    def bind_thread(self) -> None:
        """Called by the engine from the thread that runs its steps (once per
        thread): platforms that pin worker threads (CPU) re-apply their
        binding there. No-op by default."""

    def release_thread(self) -> None:
        """Called from a thread that hands the engine over to another thread
        (the server): give back what bind_thread took. No-op by default."""

    def set_device(self, index: int) -> None:
        pass

    def auto_tensor_parallel_size(self) -> int:
        """Ranks for ``--tensor-parallel-size auto``: one per device (the
        CPU: one per NUMA node with cores)."""
        return max(1, self.device_count())

    def rank_layout(self, rank: int, world_size: int, **options: Any) -> dict:
        """Where tensor parallel rank ``rank`` of ``world_size`` runs (``paged
        env``): its device here; the CPU adds its cores and NUMA node."""
        return {"rank": rank, "device": str(self.torch_device(rank))}

    def synchronize(self) -> None:
        pass

    def torch_device(self, index: int = 0):
        import torch

        return torch.device(self.device_type, index) if self.device_type != "cpu" else torch.device("cpu")

    # -- memory and dtypes -------------------------------------------------
    @abc.abstractmethod
    def memory_info(self) -> MemoryInfo:
        """Total and available memory for the KV cache budget."""

    @abc.abstractmethod
    def supported_dtypes(self) -> list:
        """torch dtypes the kernels support here, best first."""

    def default_dtype(self):
        return self.supported_dtypes()[0]

    def capabilities(self):
        """What the kernels accept and guarantee (platforms/capabilities.py),
        binding: the engine refuses anything outside it at start, and the
        conformance suite builds its cases from it. Default: any block and
        head size in ``supported_dtypes()``, batch invariant on every path."""
        from paged.platforms.capabilities import Capabilities

        return Capabilities(dtypes=tuple(self.supported_dtypes()))

    #: share of available memory the KV cache takes when no size is requested
    default_kv_cache_fraction: float = 0.25

    def kv_cache_budget_bytes(self, requested: int | None = None, profiled_peak_bytes: int | None = None) -> int:
        """Bytes for the KV cache (the Worker's sizing asks, core/engine/worker.py):
        ``requested`` (--kv-cache-memory, bytes, parsed once by EngineConfig)
        if it fits, else ``default_kv_cache_fraction`` of available memory.
        ``profiled_peak_bytes``: a worst-case step's peak where the worker
        measured one; host memory is read after loading, so the default
        ignores it. Raises ValueError with the numbers when it does not fit."""
        from paged.platforms.sizes import format_size

        avail = self.memory_info().available_bytes
        if requested is None:
            return int(avail * self.default_kv_cache_fraction)
        if not isinstance(requested, int) or requested <= 0:
            raise ValueError(f"--kv-cache-memory: expected a positive number of bytes, got {requested!r}")
        if requested > avail:
            raise ValueError(
                f"--kv-cache-memory: expected at most the {format_size(avail)} available on {self.name}, "
                f"got {format_size(requested)}")
        return requested

    # -- the worker and kernels ---------------------------------------------
    def worker_cls(self):
        """The Worker subclass (core/engine/worker.py) that runs models here:
        everything device-specific the engine needs (attention backend,
        packed-weight linears, KV cache dtype, layer ops, argmax) and the
        model, its KV memory and its steps. The default runs the plain torch
        model with the pure-torch reference attention."""
        from paged.core.engine.worker import Worker

        return Worker

    def ops_module(self):
        """The platform's compiled ops module (e.g. paged._C_cpu), or None."""
        return None

    # -- reporting ---------------------------------------------------------
    def env_report(self) -> dict:
        """What ``paged env`` prints for this platform (JSON-serialisable)."""
        a = self.is_available()
        return {"platform": self.name, "available": a.ok, "reason": a.reason}
