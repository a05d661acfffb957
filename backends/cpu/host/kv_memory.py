"""The CPU KV cache's memory: reserved whole, committed as it is used.

    kv = KvCacheMemory(num_layers, shape, dtype)
    kv.caches                      # [(key, value)] per layer, zero-filled, shape [num_blocks, ...]
    kv.written(highest_block)      # once per step: the pre-faulter moves ahead of it
    kv.committed_bytes(), kv.reserved_bytes, kv.description()

One ``paged._C_cpu.KvArena`` (csrc_cpu/runtime/kv_arena.cpp) holds every
layer's keys and values: the address space of all ``num_blocks`` blocks is
reserved at once (NUMA node preferred with mbind, transparent huge pages
advised), but a block's pages are committed only when it comes into use. The
block pool hands never-used blocks out lowest id first
(core/engine/block_pool_spec.py), so the memory in use grows from block 0
up, and the arena's background pre-faulter keeps the blocks just past the
highest one written committed: a step finds its pages there instead of
faulting them in while the thread team waits (benchmarks/kv_commit.py
measures both). The first window (``ahead`` blocks) is committed before the
engine starts.

Without the extension (or when the mmap is refused) the tensors are
``torch.zeros`` and everything is committed from the start.
"""

from __future__ import annotations

import logging
import math

import torch

log = logging.getLogger(__name__)

#: blocks committed ahead of the highest one written, at least: a
#: 512-token prompt chunk at 128-token blocks plus 28 sequences crossing into
#: a new block in the same step ...
AHEAD_MIN = 32
#: ... and at least this many bytes of every stripe: a first touch commits a
#: whole transparent huge page (2 MiB), so a window smaller than two of them
#: leaves the pre-faulter committing the very page a step is about to write
AHEAD_MIN_STRIPE_BYTES = 4 << 20


def team_cpus() -> list[int]:
    """The CPUs of the calling thread's OpenMP team, where the pre-faulter
    runs: a thread started from the pinned engine thread would otherwise
    share its one CPU."""
    from paged._C_cpu import thread_report

    return sorted({cpu for t in thread_report() for cpu in t["affinity"]})


class KvCacheMemory:
    """``num_layers`` (key, value) tensors of ``shape`` [num_blocks, ...]
    over one arena; ``prefault=False`` leaves every page to its first write
    (the benchmark's baseline), ``commit_all=True`` commits everything now
    (what the cache did before it was lazy)."""

    def __init__(self, num_layers: int, shape, dtype: torch.dtype, node: int | None = None,
                 prefault: bool = True, commit_all: bool = False):
        shape = tuple(int(s) for s in shape)
        if num_layers <= 0 or not shape or any(s <= 0 for s in shape):
            raise ValueError(f"KV cache: expected num_layers > 0 and a positive shape, got {num_layers} x {shape}")
        self.num_blocks = shape[0]
        self.block_bytes = math.prod(shape[1:]) * torch.empty((), dtype=dtype).element_size()
        self.prefault = prefault
        self.ahead = max(AHEAD_MIN, -(-AHEAD_MIN_STRIPE_BYTES // self.block_bytes))
        self._highest = -1  # the highest block id any step has written
        self.arena = self._arena(2 * num_layers, node)
        if self.arena is None:
            self.caches = [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
                           for _ in range(num_layers)]
            return
        stripes = [torch.from_dlpack(self.arena.stripe(i)).view(dtype).view(shape) for i in range(2 * num_layers)]
        self.caches = list(zip(stripes[0::2], stripes[1::2]))
        # the first window before the engine starts (tenths of a second): the
        # first steps follow at once (warm-up, a request) and must not fault
        self.arena.commit(self.num_blocks if commit_all else min(self.ahead, self.num_blocks) if prefault else 0)

    def _arena(self, stripes: int, node: int | None):
        """The KvArena, or None (logged) where there is none to be had."""
        try:
            from paged._C_cpu import KvArena

            arena = KvArena(stripes, self.num_blocks, self.block_bytes, -1 if node is None else node, team_cpus())
        except Exception as e:  # no extension, mmap refused: plain memory still works
            log.warning("KV cache: no on-demand arena (%s); committing all of it now", e)
            return None
        if arena.numa_reason:
            log.info("KV cache: NUMA node policy not applied (%s)", arena.numa_reason)
        return arena

    @property
    def reserved_bytes(self) -> int:
        """Bytes of the cache's blocks (the address space held for them)."""
        return 2 * len(self.caches) * self.num_blocks * self.block_bytes

    def committed_bytes(self) -> int:
        """Bytes of the cache resident now (the kernel's count: whole pages,
        so a huge page of every layer at least once anything is written)."""
        if self.arena is None:
            return self.reserved_bytes
        resident = self.arena.resident_bytes()
        return self.reserved_bytes if resident < 0 else min(resident, self.reserved_bytes)

    @property
    def highest_written(self) -> int:
        """The highest block id a step has written (-1: none yet)."""
        return self._highest

    def written(self, highest_block: int) -> None:
        """A step writes blocks up to ``highest_block``: the pre-faulter is
        sent past it by ``ahead`` blocks (at least AHEAD_MIN and
        AHEAD_MIN_STRIPE_BYTES of every stripe), which grows to twice the
        most new blocks one step has reached into, so a burst of prompt
        chunks stays covered."""
        if highest_block <= self._highest:
            return
        self.ahead = max(self.ahead, 2 * (highest_block - self._highest))
        self._highest = highest_block
        if self.arena is not None and self.prefault:
            self.arena.prefault(highest_block + 1 + self.ahead)

    def description(self) -> str:
        """'5.41 GiB reserved, 0.12 GiB committed' for the start-up line."""
        return f"{self.reserved_bytes / 2**30:.2f} GiB reserved, {self.committed_bytes() / 2**30:.2f} GiB committed"
