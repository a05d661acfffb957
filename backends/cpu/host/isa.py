"""Which SIMD build each CPU kernel family runs, and ISA *levels*: the CPU
generations the suite and users can select.

The builds and levels are one C++ table (csrc_cpu/kernel_builds.cpp), read
here through ``paged._C_cpu.kernel_builds()`` and ``kernel_levels()``: every
family's builds best first, each with the level it belongs to and whether
this CPU runs it; the levels of this architecture best first (x86-64:
avx512, avx2, scalar; aarch64: i8mm, dotprod, neon, scalar), each with the
features PAGED_CPU_HIDE hides to reach it. A level caps every family at once:

- in another process, through ``PAGED_CPU_HIDE`` (``hide_env(level)``), which
  hides the newer features from the detector itself, so dtype choice, `paged
  env` and every kernel family see the older generation end to end;
- in this process, through ``use_level(level)``, which sets each family's
  build directly (the detector's answer cannot change after import).

The families chosen by name (attention, linear, fused ops) are the ones
``active_builds`` reports and ``use_level`` sets; the rest of the table (the
prompt-row kernels, the float16 cache writes) follows the CPU on its own.
Nothing here imports the compiled module until a function (or ``LEVELS``)
is used, so ``paged.platforms.cpu`` imports where it is not built.
"""

from __future__ import annotations

import contextlib
import platform
from typing import Iterator


def machine_arch(machine: str | None = None) -> str:
    """x86_64, aarch64 (Linux's and macOS's arm64) or the machine's own name."""
    m = (machine or platform.machine()).lower()
    return {"amd64": "x86_64", "x64": "x86_64", "arm64": "aarch64"}.get(m, m)


def _ops():
    from paged import _C_cpu

    return _C_cpu


def _levels() -> list[dict]:
    """kernel_levels(): this architecture's levels, best first."""
    return _ops().kernel_levels()


def _selectable() -> dict[str, list[dict]]:
    """family -> its builds, best first, for the families chosen by name."""
    return {family: f["builds"] for family, f in _ops().kernel_builds().items() if f["selectable"]}


def __getattr__(name: str):
    # LEVELS: the levels of this architecture, best first (read from the table on first use)
    if name == "LEVELS":
        return tuple(level["name"] for level in _levels())
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def active_builds() -> dict[str, str]:
    """family -> the build it runs now (the families chosen by name)."""
    return {family: next(b["name"] for b in builds if b["active"]) for family, builds in _selectable().items()}


def supported_levels() -> list[str]:
    """Levels this machine (as the detector sees it) can run, best first."""
    return [level["name"] for level in _levels() if level["runs"]]


def _check_level(level: str) -> dict:
    levels = _levels()
    for entry in levels:
        if entry["name"] == level:
            return entry
    names = ", ".join(entry["name"] for entry in levels)
    raise ValueError(f"level: expected one of {names}, got {level!r}")


def hide_env(level: str) -> dict[str, str]:
    """Environment that runs a child process at ``level`` (PAGED_CPU_HIDE)."""
    return {"PAGED_CPU_HIDE": _check_level(level)["hides"]}


def builds_for_level(level: str) -> dict[str, str]:
    """family -> the best build it has at or below ``level`` on this CPU."""
    _check_level(level)
    rank = {entry["name"]: i for i, entry in enumerate(_levels())}
    cap = rank[level]
    chosen = {}
    for family, builds in _selectable().items():
        allowed = [b["name"] for b in builds if b["runs"] and rank.get(b["level"], len(rank)) >= cap]
        chosen[family] = allowed[0] if allowed else "scalar"
    return chosen


@contextlib.contextmanager
def use_level(level: str) -> Iterator[dict[str, str]]:
    """Run every kernel family at ``level`` inside the block (back to auto after)."""
    ops = _ops()
    chosen = builds_for_level(level)
    try:
        for family, build in chosen.items():
            ops.set_kernel_build(family, build)
        yield chosen
    finally:
        for family in chosen:
            ops.set_kernel_build(family, "auto")
