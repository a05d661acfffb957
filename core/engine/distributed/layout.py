"""How many ranks, and who launched them: no torch import here, so the CLI
can ask (``paged env``, the torchrun follower check) without loading it."""

from __future__ import annotations

import os

#: the CPUs this process could use when paged was imported, before any
#: thread was pinned: spawned ranks start from it, not from their parent
#: thread's pinned mask
INITIAL_AFFINITY = frozenset(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else frozenset()


class RankFailed(RuntimeError):
    """A tensor parallel rank died or could not join; the group is unusable."""


def torchrun_env() -> tuple[int, int] | None:
    """(rank, world size) from torchrun's environment (or MASTER_ADDR /
    RANK / WORLD_SIZE set by hand), or None outside it."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return None


def resolve_size(value, platform) -> int:
    """"auto": the platform's natural split (CPU: one rank per NUMA node;
    a device platform: its device count); an int: itself (>= 1)."""
    if value == "auto":
        return max(1, platform.auto_tensor_parallel_size())
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"tensor_parallel_size: expected a positive integer or 'auto', got {value!r}")
    return value
