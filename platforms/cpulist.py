"""CPU list syntax shared by sysfs and ``--cpu-threads-bind``: "0-3,8,10-11".

Parsing is strict because a typo here silently changes which cores serve.
"""

from __future__ import annotations

from collections.abc import Iterable


def parse_cpulist(text: str, allowed: Iterable[int] | None = None, *, allow_empty: bool = False) -> list[int]:
    """CPUs named by ``text``, sorted. ``allowed``: the CPUs this process may
    use; naming any other is an error. ``allow_empty`` accepts "" (sysfs
    writes an empty list for a node without CPUs)."""
    if not isinstance(text, str):
        raise ValueError(f"CPU list must be a string, got {text!r}")
    stripped = text.strip()
    if not stripped:
        if allow_empty:
            return []
        raise ValueError("CPU list is empty (expected e.g. '0-3,8')")
    cpus: list[int] = []
    for entry in stripped.split(","):
        entry = entry.strip()
        if not entry:
            raise ValueError(f"CPU list {text!r} has an empty entry")
        first, sep, last = entry.partition("-")
        lo, hi = _cpu_number(first, entry, text), _cpu_number(last, entry, text) if sep else None
        if hi is None:
            hi = lo
        if hi < lo:
            raise ValueError(f"CPU range {entry!r} in {text!r} is reversed (write {hi}-{lo})")
        cpus.extend(range(lo, hi + 1))
    seen = set()
    duplicates = sorted({c for c in cpus if c in seen or seen.add(c)})
    if duplicates:
        raise ValueError(f"CPU list {text!r} names CPU {format_cpulist(duplicates)} more than once")
    if allowed is not None:
        allowed_set = set(allowed)
        outside = sorted(set(cpus) - allowed_set)
        if outside:
            raise ValueError(
                f"CPU {format_cpulist(outside)} in CPU list {text!r} is not allowed for this process "
                f"(allowed: {format_cpulist(allowed_set) or 'none'})"
            )
    return sorted(cpus)


def _cpu_number(token: str, entry: str, text: str) -> int:
    token = token.strip()
    if not token.isdigit():  # also rejects signs, spaces and non-ASCII digits
        raise ValueError(f"{entry!r} in CPU list {text!r} is not a CPU number or a range like 0-3")
    return int(token)


def format_cpulist(cpus: Iterable[int]) -> str:
    """The compact form of a set of CPUs: [0, 1, 2, 3, 8] -> "0-3,8"."""
    parts: list[str] = []
    ordered = sorted(set(cpus))
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        parts.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(parts)
