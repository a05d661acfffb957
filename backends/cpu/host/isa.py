"""Which SIMD build each CPU kernel family runs, and ISA *levels*: the CPU
generations the suite and users can select.

Every family (attention, linear, fused ops) names its builds from one
vocabulary, ranked here; the C++ side (csrc_cpu/isa_select.h,
csrc_cpu/kernel_builds.cpp) compiles the builds of the target architecture and
picks the best one the CPU feature detector allows. Levels are per
architecture (x86-64: avx512, avx2, scalar; aarch64: i8mm, dotprod, neon, scalar).
A level caps every family at once:

- in another process, through ``PAGED_CPU_HIDE`` (``hide_env(level)``), which
  hides the newer features from the detector itself, so dtype choice, `paged
  env` and every kernel family see the older generation end to end;
- in this process, through ``use_level(level)``, which sets each family's
  build directly (the detector's answer cannot change after import).
"""

from __future__ import annotations

import contextlib
import platform
from typing import Iterator

#: build names, best first within each architecture; every family's builds are a subset.
#: The linear's amx build (AMX-INT8 tiles, bitwise avx512's) belongs to the avx512
#: level but ranks below it: auto never picks it (csrc_cpu/kernel_builds.cpp).
RANKED_BUILDS = ("avx512", "amx", "avxvnni", "avx2", "i8mm", "dotprod", "neon", "scalar")
#: per architecture: levels, best first, and the features PAGED_CPU_HIDE hides for each
_ARCH_LEVELS = {
    "x86_64": {"avx512": "", "avx2": "avx512,avxvnni", "scalar": "avx2"},
    "aarch64": {"i8mm": "", "dotprod": "i8mm", "neon": "dotprod,i8mm,sve", "scalar": "neon"},
}


def machine_arch(machine: str | None = None) -> str:
    """x86_64, aarch64 (Linux's and macOS's arm64) or the machine's own name."""
    m = (machine or platform.machine()).lower()
    return {"amd64": "x86_64", "x64": "x86_64", "arm64": "aarch64"}.get(m, m)


#: levels this machine's architecture has (other CPUs: scalar only)
_HIDE = _ARCH_LEVELS.get(machine_arch(), {"scalar": ""})
LEVELS = tuple(_HIDE)
#: family -> (current build, set build, builds this CPU runs) in paged._C_cpu
_FAMILIES = {
    "attention": ("attention_isa", "set_attention_isa", "supported_attention_isas"),
    "linear": ("linear_isa", "set_linear_isa", "supported_linear_isas"),
    "fused_ops": ("fused_ops_isa", "set_fused_ops_isa", "supported_fused_ops_isas"),
}


def _ops():
    from paged import _C_cpu

    return _C_cpu


def active_builds() -> dict[str, str]:
    """family -> the build it runs now."""
    ops = _ops()
    return {family: getattr(ops, names[0])() for family, names in _FAMILIES.items()}


def supported_levels() -> list[str]:
    """Levels this machine (as the detector sees it) can run, best first: a
    level is there when some family's selector offers a build of its name
    (the C++ side decides what a build needs, csrc_cpu/isa_select.h)."""
    ops = _ops()
    offered = {b for names in _FAMILIES.values() for b in getattr(ops, names[2])()}
    return [level for level in LEVELS if level in offered]


def _check_level(level: str) -> str:
    if level not in LEVELS:
        raise ValueError(f"level: expected one of {', '.join(LEVELS)}, got {level!r}")
    return level


def hide_env(level: str) -> dict[str, str]:
    """Environment that runs a child process at ``level`` (PAGED_CPU_HIDE)."""
    return {"PAGED_CPU_HIDE": _HIDE[_check_level(level)]}


def _rank(build: str) -> int:
    return RANKED_BUILDS.index(build) if build in RANKED_BUILDS else len(RANKED_BUILDS)


def builds_for_level(level: str) -> dict[str, str]:
    """family -> the best build it has at or below ``level`` on this CPU."""
    ops = _ops()
    cap = _rank(_check_level(level))
    chosen = {}
    for family, (_, _, supported) in _FAMILIES.items():
        builds = [b for b in getattr(ops, supported)() if _rank(b) >= cap]
        chosen[family] = builds[0] if builds else "scalar"
    return chosen


@contextlib.contextmanager
def use_level(level: str) -> Iterator[dict[str, str]]:
    """Run every kernel family at ``level`` inside the block (back to auto after)."""
    ops = _ops()
    chosen = builds_for_level(level)
    try:
        for family, build in chosen.items():
            getattr(ops, _FAMILIES[family][1])(build)
        yield chosen
    finally:
        for family in _FAMILIES:
            getattr(ops, _FAMILIES[family][1])("auto")
