"""The Platform interface: everything core/ needs to know about a device.

core/ never imports a device library (torch.cuda, torch_npu) itself; it asks
the current platform. Built-ins: cpu, cuda, npu; third-party platforms
register through the ``paged.platforms`` entry-point group.
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
        """The Worker subclass (core/engine/worker.py) that runs models here: loads
        the model, picks its layer ops, sizes and allocates the KV memory and
        runs steps. The default runs the plain torch model."""
        from paged.core.engine.worker import Worker

        return Worker

    #: --kv-cache-dtype names the kernels store besides the model dtype
    #: (torch dtype names, or "fp8_e4m3" for float8_e4m3fn; "int8" and
    #: "fp8_e4m3": backends/base.py's quantized rows). Other
    #: platforms refuse them at start until their kernels implement them.
    extra_kv_cache_dtypes: tuple = ()

    def resolve_kv_cache_dtype(self, choice: str | None, model_dtype, linear_activations: str | None = None):
        """The torch dtype the KV cache stores for --kv-cache-dtype ``choice``
        (auto / None: ``auto_kv_cache_dtype``); ValueError, one line, for one
        this platform does not run. ``linear_activations``: the resolved
        packed-linear mode (None: weights not packed)."""
        import torch

        if choice in (None, "auto"):
            return self.auto_kv_cache_dtype(model_dtype, linear_activations)
        # fp8_e4m3 names torch.float8_e4m3fn (rows with a scale, like int8)
        dtype = torch.float8_e4m3fn if choice == "fp8_e4m3" else getattr(torch, str(choice), None)
        if dtype == model_dtype:
            return dtype
        if not isinstance(dtype, torch.dtype) or str(choice) not in self.extra_kv_cache_dtypes:
            from paged.platforms.capabilities import dtype_name

            model = dtype_name(model_dtype)
            allowed = ", ".join(["auto", model, *(d for d in self.extra_kv_cache_dtypes if d != model)])
            raise ValueError(f"--kv-cache-dtype on {self.name}: expected one of {allowed} "
                             f"(the {model} model's own dtype or what its kernels implement), got {choice!r}")
        return dtype

    def auto_kv_cache_dtype(self, model_dtype, linear_activations: str | None = None):
        """--kv-cache-dtype auto: the model dtype unless the platform knows better."""
        return model_dtype

    def select_attention_backend(self, choice: str | None = None):
        """The attention backend class for --attention-backend ``choice``:
        None = this platform's own, "reference" = the pure-torch oracle."""
        if choice == "reference":
            from paged.backends.reference.attention import ReferenceBackend

            return ReferenceBackend
        return self.attention_backend_cls()

    @abc.abstractmethod
    def attention_backend_cls(self):
        """The AttentionBackend subclass (backends/base.py) for this device."""

    def ops_module(self):
        """The compiled ops module (e.g. paged._C_cpu), or None."""
        return None

    def argmax(self, logits):
        """Greedy tokens: int64 [N], the first index of each row's maximum
        of ``logits`` [N, V], exactly as torch.argmax (a NaN counts as the
        maximum). The sampler's argmax; a platform with a faster kernel
        overrides it."""
        return logits.argmax(dim=-1)

    def packed_linear_cls(self, activations: str = "auto"):
        """A callable wrapping a loader's PackedBlocks (GGUF Q4_0/Q4_1/Q8_0)
        as a weight with ``linear(x, bias)`` whose activations are
        ``activations`` (--linear-activations: auto picks the platform's
        choice), or None when this platform has no kernels for packed weights
        (they are then dequantized at load)."""
        return None

    def linear_activations(self, setting: str = "auto") -> str | None:
        """What --linear-activations ``setting`` runs here ("float32",
        "int8", "int8x2"), or None without packed-weight kernels."""
        return None

    def block_pool_cls(self):
        """The block accounting (ids, ref counts, LRU, prefix hashes): one
        class for every platform, since block ids never touch device memory
        (docs/architecture.md, "Block accounting"). The C++ pool of _C_cpu,
        or its pure-Python twin where the extension is not built."""
        try:
            from paged._C_cpu import BlockPool
        except ImportError:
            from paged.core.engine.block_pool_spec import BlockPoolModel as BlockPool
        return BlockPool

    def block_hash_fn(self):
        """hash_block(parent, tokens, extra=None) -> int, matching block_pool_cls."""
        try:
            from paged._C_cpu import hash_block
        except ImportError:
            from paged.core.engine.block_pool_spec import hash_block
        return hash_block

    # -- reporting ---------------------------------------------------------
    def startup_summary(self) -> str:
        """One line for the engine's start-up log: threads, devices and the
        kernel builds in use (empty when there is nothing to add)."""
        return ""

    def env_report(self) -> dict:
        """What ``paged env`` prints for this platform (JSON-serialisable)."""
        a = self.is_available()
        return {"platform": self.name, "available": a.ok, "reason": a.reason}
