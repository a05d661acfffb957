"""CPU list syntax shared by sysfs and ``--cpu-threads-bind``: "0-3,8,10-11".

Parsing is strict because a typo here silently changes which cores serve.
Ranges are checked against the highest CPU they may name before they are
expanded: "0-99999999" would otherwise become a list of 10^8 numbers.
"""

from __future__ import annotations

from collections.abc import Iterable

#: the highest CPU number any Linux build can have (x86 MAXSMP: NR_CPUS 8192);
#: the bound for lists read without an allowed set (sysfs)
MAX_CPU = 8191


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
    allowed_set = None if allowed is None else set(allowed)
    ceiling = MAX_CPU if allowed_set is None else max(allowed_set, default=-1)
    cpus, beyond = _expand([_cpu_range(entry, text) for entry in stripped.split(",")], ceiling)
    seen: set[int] = set()
    duplicates = sorted({c for c in cpus if c in seen or seen.add(c)})
    if duplicates:
        raise ValueError(f"CPU list {text!r} names CPU {format_cpulist(duplicates)} more than once")
    if allowed_set is None:
        if beyond:
            raise ValueError(f"CPU list {text!r}: expected CPU numbers up to {MAX_CPU} "
                             f"(the most Linux supports), got {beyond}")
        return sorted(cpus)
    outside = ",".join(filter(None, (format_cpulist(set(cpus) - allowed_set), beyond)))
    if outside:
        raise ValueError(f"CPU {outside} in CPU list {text!r} is not allowed for this process "
                         f"(allowed: {format_cpulist(allowed_set) or 'none'})")
    return sorted(cpus)


def _expand(ranges: list[tuple[int, int]], ceiling: int) -> tuple[list[int], str]:
    """The CPUs of ``ranges`` up to ``ceiling``, and the parts above it as text:
    only the first are expanded, so a huge range costs nothing."""
    cpus = [cpu for lo, hi in ranges for cpu in range(lo, min(hi, ceiling) + 1)]
    beyond = ",".join(_format_range(max(lo, ceiling + 1), hi) for lo, hi in sorted(ranges) if hi > ceiling)
    return cpus, beyond


def _cpu_range(entry: str, text: str) -> tuple[int, int]:
    """One entry, "3" or "0-3", as (first, last)."""
    entry = entry.strip()
    if not entry:
        raise ValueError(f"CPU list {text!r} has an empty entry")
    first, sep, last = entry.partition("-")
    lo = _cpu_number(first, entry, text)
    hi = _cpu_number(last, entry, text) if sep else lo
    if hi < lo:
        raise ValueError(f"CPU range {entry!r} in {text!r} is reversed (write {hi}-{lo})")
    return lo, hi


def _cpu_number(token: str, entry: str, text: str) -> int:
    token = token.strip()
    if not token.isdigit():  # also rejects signs, spaces and non-ASCII digits
        raise ValueError(f"{entry!r} in CPU list {text!r} is not a CPU number or a range like 0-3")
    return int(token)


def _format_range(lo: int, hi: int) -> str:
    return str(lo) if lo == hi else f"{lo}-{hi}"


def format_cpulist(cpus: Iterable[int]) -> str:
    """The compact form of a set of CPUs: [0, 1, 2, 3, 8] -> "0-3,8"."""
    parts: list[str] = []
    ordered = sorted(set(cpus))
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        parts.append(_format_range(ordered[i], ordered[j]))
        i = j + 1
    return ",".join(parts)
