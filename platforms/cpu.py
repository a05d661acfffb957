"""The CPU platform: NUMA-aware, one pinned OpenMP thread per physical core.

Pinning and the memory policy happen inside the C++ runtime (paged._C_cpu,
csrc_cpu/runtime/); this module decides *what* to bind from the sysfs
topology (backends/cpu/host/topology.py). See docs/platforms.md.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from paged.backends.cpu.host import isa as cpu_isa
from paged.backends.cpu.host.binding import BindingPlan, plan_binding
from paged.backends.cpu.host.cpulist import format_cpulist
from paged.backends.cpu.host.load import LoadWatch
from paged.backends.cpu.host.topology import (Topology, can_pin_threads, process_cpus, read_topology, set_thread_cpus,
                                              system_memory)
from paged.platforms.base import Availability, MemoryInfo, Platform

log = logging.getLogger(__name__)


class CpuPlatform(Platform):
    name = "cpu"
    device_type = "cpu"
    dist_backend = "gloo"
    auto_priority = 10
    # Decode attention streams each block's K and V rows of one head as one
    # contiguous run; at 16 tokens that run is 2 KB (bf16, head 64), too
    # short for the hardware prefetcher. 128 streams ~15-25% faster at long
    # contexts (docs/kernels.md), at the cost of a coarser prefix cache.
    default_block_size = 128
    # the attention kernels read any of these under any model dtype (int8,
    # fp8_e4m3: per-token scales, dequantized in registers; docs/kernels.md)

    def __init__(self, sysfs_root: str | os.PathLike = "/sys", allowed: list[int] | set[int] | None = None):
        self._sysfs_root = sysfs_root
        self._allowed = allowed
        self._topology: Topology | None = None
        self.plan: BindingPlan | None = None  # set by init()
        self._bound_tid: int | None = None  # native id of the thread whose OpenMP team is pinned

    # -- detection ---------------------------------------------------------
    def is_available(self) -> Availability:
        try:
            self.ops_module().cpu_features()
        except ImportError as e:
            return Availability(False, f"paged._C_cpu is not built ({e}); reinstall: pip install -e .")
        except ValueError as e:  # a bad PAGED_CPU_HIDE
            return Availability(False, str(e))
        return Availability(True)

    def device_count(self) -> int:
        return 1

    def auto_tensor_parallel_size(self) -> int:
        """One rank per NUMA node with usable cores."""
        return max(1, sum(1 for n in self.topology().nodes if n.cores))

    def rank_layout(self, rank: int, world_size: int, threads_bind: str = "auto", **options: Any) -> dict:
        plan = plan_binding(threads_bind, self.topology(), rank, world_size)
        return {"rank": rank, "device": "cpu", "cpus": format_cpulist(plan.cpus) or "not pinned",
                "threads": len(plan.cpus), "node": plan.node}

    def topology(self) -> Topology:
        if self._topology is None:
            self._topology = read_topology(self._sysfs_root, self._process_cpus())
        return self._topology

    def _process_cpus(self) -> list[int] | set[int]:
        """The CPUs this process may use. Once threads are pinned the calling
        thread's mask is one CPU, so prefer the mask the runtime captured at
        import, before any pinning."""
        if self._allowed is not None:
            return self._allowed
        try:
            return self.ops_module().initial_allowed_cpus()
        except ImportError:
            return process_cpus()

    # -- lifecycle ---------------------------------------------------------
    def init(self, threads_bind: str = "auto", rank: int = 0, world_size: int = 1, **options: Any) -> None:
        """Pin OpenMP (and torch's intra-op) threads and bind memory to the
        node of those threads. ``threads_bind``: auto | none | CPU list(s),
        one per tensor parallel rank."""
        plan = plan_binding(threads_bind, self.topology(), rank, world_size)
        ops = self.ops_module()
        self.plan = plan
        self._bound_tid = None
        # auto gives up cores other processes keep busy (see bind_thread)
        self._load_watch = LoadWatch(plan.cpus) if plan.spec == "auto" else None
        self.bind_thread()
        if plan.node is not None:
            try:
                plan.memory_method = ops.bind_memory_to_node(plan.node)
            except (RuntimeError, ValueError) as e:  # e.g. a seccomp profile forbids set_mempolicy
                plan.memory_method = f"not bound: {e}"
                log.warning("memory not bound to NUMA node %d: %s", plan.node, e)

    def bind_thread(self) -> None:
        """Pin the calling thread's OpenMP team to the plan's CPUs.

        OpenMP teams belong to the thread that opens them: a thread started
        after init() (the server's engine thread) would otherwise get fresh
        workers inheriting its creator's single-CPU affinity, i.e. every
        thread on one core. The previously bound thread (pinned to the first
        CPU as OpenMP thread 0) is released to all allowed CPUs so it does not
        compete with the new one.

        Under ``auto`` it is also where the team adapts (the engine calls it
        before every step): a core other processes keep busy would make every
        parallel region wait for its thread, so LoadWatch drops it, and
        restores it once free (backends/cpu/host/load.py)."""
        if self.plan is None or not self.plan.cpus:
            return
        tid = threading.get_native_id()
        cpus = self._load_watch.poll(self.plan.cpus) if self._load_watch else None
        if cpus:
            self.plan.cpus = cpus
        elif tid == self._bound_tid:
            return
        import torch

        torch.set_num_threads(len(self.plan.cpus))
        self.ops_module().bind_threads(self.plan.cpus)
        if self._bound_tid not in (None, tid):
            try:
                set_thread_cpus(self._bound_tid, self._process_cpus())
            except OSError:  # that thread has exited
                pass
        self._bound_tid = tid

    def release_thread(self) -> None:
        """Free the calling thread's OpenMP pool and CPU pin before another
        thread takes the work over: libgomp barely spins (futex sleeps at
        every region) once it manages more threads than CPUs, which halved
        the engine thread's kernel speed in the server."""
        if self._bound_tid != threading.get_native_id():
            return
        self.ops_module().release_thread_pool()
        set_thread_cpus(0, self._process_cpus())
        self._bound_tid = None

    # -- memory and dtypes -------------------------------------------------
    def memory_info(self) -> MemoryInfo:
        """The bound node's MemTotal/MemFree on a multi-node machine; the
        machine's /proc/meminfo (MemAvailable) when unbound, when sysfs has no
        node meminfo, or when there is one node: the node is then the whole
        machine, MemAvailable counts the reclaimable page cache, and some VMs'
        node meminfo leaves out hot-plugged memory (a 24 GiB guest whose
        node0 lists 5.3 GiB)."""
        if self.plan is not None and self.plan.node is not None and len(self.topology().nodes) > 1:
            node = self.topology().node(self.plan.node)
            if node.mem_total_bytes is not None and node.mem_free_bytes is not None:
                return MemoryInfo(node.mem_total_bytes, node.mem_free_bytes)
        total, available = system_memory()
        return MemoryInfo(total, available)

    def cpu_features(self) -> dict[str, bool]:
        return dict(self.ops_module().cpu_features())

    def capabilities(self):
        """Head sizes: multiples of 16 up to 256 (the attention kernels'
        check). Batch invariance: the attention kernels in every dtype; the
        engine path in float32 (bitwise with int8x2 / int8 activations, equal
        greedy tokens with float32 ones) but not in bf16 / fp16, whose
        activations are rounded between ops (docs/kernels.md, "Batch
        invariance, per CPU path")."""
        import torch

        from paged.platforms.capabilities import Capabilities, dtype_name

        dtypes = tuple(self.supported_dtypes())
        return Capabilities(dtypes=dtypes, head_size_multiple=16, max_head_size=256,
                            batch_invariant={dtype_name(d): ("decode", "prefill", "engine") if d == torch.float32
                                             else ("decode", "prefill") for d in dtypes})

    def supported_dtypes(self) -> list:
        """float32 first on every CPU: it is what ``--dtype auto`` runs. The
        bf16 path rounds activations and KV to 8 mantissa bits, and on the
        default model that flips near-tie greedy tokens against HF float32
        (docs/kernels.md, "Choosing the CPU path"), while GGUF weights stay
        packed either way, so float32 costs no weight bandwidth. bfloat16 is
        there to ask for (native where AVX512_BF16/AMX exist, else converted);
        float16 where the CPU converts it (F16C; every aarch64 core)."""
        import torch

        features = self.cpu_features()
        dtypes = [torch.float32, torch.bfloat16]
        if features.get("f16c") or features.get("avx512fp16") or features.get("asimd"):
            dtypes.append(torch.float16)
        return dtypes

    def kernel_builds(self) -> dict[str, str]:
        """Kernel family -> the SIMD build it runs (backends/cpu/host/isa.py)."""
        return cpu_isa.active_builds()

    def worker_cls(self):
        from paged.backends.cpu.worker import CpuWorker

        return CpuWorker

    def ops_module(self):
        from paged import _C_cpu

        return _C_cpu

    # -- reporting ---------------------------------------------------------
    def env_report(self) -> dict:
        report = super().env_report()
        topo = self.topology()
        report["topology"] = topo.to_dict()
        report["binding"] = self.plan.to_dict() if self.plan else None
        if not can_pin_threads():  # macOS: the plan sets the thread count only
            report["pinning"] = "none: this OS has no CPU affinity API, threads run where it puts them"
        if not report["available"]:
            return report
        ops = self.ops_module()
        report["threads"] = ops.thread_report() if self.plan and self.plan.cpus else None
        report["memory_policy"] = ops.memory_policy()
        report["libnuma"] = ops.libnuma_available()
        report["cpu_features"] = self.cpu_features()
        report["cpu_features_hidden"] = ops.hidden_cpu_features()
        report["kernel_builds"] = self.kernel_builds()
        from paged.backends.cpu import quant_linear

        # what --linear-activations auto runs here
        report["linear_activations"] = quant_linear.resolve_activations("auto") if quant_linear.available() else None
        report["dtypes"] = [str(d).removeprefix("torch.") for d in self.supported_dtypes()]
        mem = self.memory_info()
        report["memory"] = {"total_bytes": mem.total_bytes, "available_bytes": mem.available_bytes}
        report["kv_cache_budget_bytes"] = self.kv_cache_budget_bytes()
        return report
