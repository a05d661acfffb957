"""Handing the loader's freed memory back to the system.

Loading a GGUF model frees most of what it allocates (file blocks copied
off the mapping, dequantization and repacking temporaries) in many small
pieces; glibc keeps those pages in its heap, where they count in the
process's RSS (131 MiB of a 1B Q4_0 model's load, benchmarks/quant_types.py).
``malloc_trim(0)`` returns the free pages. Elsewhere (musl, macOS) it does
nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.lru_cache(maxsize=None)
def _malloc_trim():
    name = ctypes.util.find_library("c")
    try:
        fn = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None
    if fn is not None:
        fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


def release_free_heap() -> bool:
    """Returns free heap pages to the system; True where the C library can."""
    fn = _malloc_trim()
    if fn is None:
        return False
    fn(0)
    return True
