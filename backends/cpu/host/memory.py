"""NUMA-local host memory (the KV cache has its own on-demand arena:
backends/cpu/host/kv_memory.py).

    t = numa_zeros(shape, dtype, node=None, populate=True)   # torch.Tensor, zero-filled
    last_allocation() -> dict(method="host_arena"|"torch.zeros", node, numa_policy, reason)

``numa_zeros`` allocates through the C++ host arena (paged._C_cpu.host_arena_zeros:
page-aligned anonymous mmap, preferred NUMA node set with mbind before first
touch, unmapped when the tensor's last owner goes). node=None means the node
of the calling thread (the engine thread, pinned by the CPU platform).
populate=True faults every page in at once on the thread team; False
leaves the pages to fault on first use. If anything fails it falls back to
torch.zeros; ``last_allocation()`` says which path was taken and why, so
`paged env` / the backend can report it.
"""

from __future__ import annotations

import logging
import math

import torch

log = logging.getLogger(__name__)

_last: dict = {}


def last_allocation() -> dict:
    """How the most recent numa_zeros call got its memory."""
    return dict(_last)


def _record(method: str, node, numa_policy: str, reason: str = "") -> None:
    _last.clear()
    _last.update(method=method, node=node, numa_policy=numa_policy, reason=reason)
    if reason:
        log.info("numa_zeros: %s (%s)", method, reason)


def numa_zeros(shape, dtype: torch.dtype, node: int | None = None, populate: bool = True) -> torch.Tensor:
    shape = tuple(int(s) for s in shape)
    if any(s < 0 for s in shape):
        raise ValueError(f"numa_zeros: negative dimension in shape {shape}")
    if node is not None and node < 0:
        raise ValueError(f"numa_zeros: node must be >= 0 or None, got {node}")
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        _record("torch.zeros", node, "none", "empty tensor")
        return torch.zeros(shape, dtype=dtype)
    try:
        from paged._C_cpu import host_arena_zeros

        raw, why_not = host_arena_zeros(nbytes, -1 if node is None else node, populate)
        tensor = torch.from_dlpack(raw).view(dtype).view(shape)
    except Exception as e:  # no extension, mmap refused, odd dtype: plain memory still works
        _record("torch.zeros", node, "none", f"host arena unavailable: {e}")
        return torch.zeros(shape, dtype=dtype)
    _record("host_arena", node, "default" if why_not else "preferred", why_not)
    return tensor
