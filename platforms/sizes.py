"""Human-readable memory sizes for options like ``--kv-cache-memory``.

Units are case-insensitive. Binary: K, M, G, T, KiB, MiB, GiB, TiB (powers of
1024, as ``free -h`` and container limits mean them); decimal: KB, MB, GB, TB.
A bare number, or one ending in B, is bytes.
"""

from __future__ import annotations

import re

_UNITS = {
    "": 1, "b": 1,
    "k": 2**10, "kib": 2**10, "kb": 10**3,
    "m": 2**20, "mib": 2**20, "mb": 10**6,
    "g": 2**30, "gib": 2**30, "gb": 10**9,
    "t": 2**40, "tib": 2**40, "tb": 10**12,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_size(text: str | int, bare_unit: str = "B") -> int:
    """Bytes in "2GiB", "512MiB", "1.5G", "1000000" (fractions round down).
    An int is bytes; a unit-less string is in ``bare_unit`` (bytes by
    default; the engine's --kv-cache-memory reads "4" as 4 GiB)."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise ValueError(f"memory size {text} is negative")
        return text
    match = _SIZE.match(text) if isinstance(text, str) else None
    if match is None:
        raise ValueError(f"invalid memory size {text!r} (expected e.g. 2GiB, 512MiB, 1.5G or a byte count)")
    number, unit = match.groups()
    factor = _UNITS.get((unit or bare_unit).lower())
    if factor is None:
        raise ValueError(f"invalid memory size {text!r}: unknown unit {unit!r} (use B, KiB, MiB, GiB, TiB, KB, MB, GB, TB)")
    return int(float(number) * factor) if "." in number else int(number) * factor


def format_size(num_bytes: int) -> str:
    """1610612736 -> "1.50 GiB" (for messages)."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.2f} {unit}" if unit != "B" else f"{int(value)} B"
        value /= 1024
    return f"{value:.2f} TiB"
