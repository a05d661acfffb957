"""The one vocabulary for argument errors in the Python backends.

Every message has the shape ``name: expected X, got Y`` (the C++ modules use
csrc_shared/arg_error.h for the same shape), so a user reads one format
whatever device rejected the call. The exception type says what went wrong:
ValueError for a bad shape / dtype / device / value, IndexError for an id
outside its range, TypeError for something that is not a tensor.
"""

from __future__ import annotations


def expected(name: str, want, got) -> str:
    """The message: ``name: expected want, got got``."""
    return f"{name}: expected {want}, got {got}"


def fail(name: str, want, got):
    raise ValueError(expected(name, want, got))


def fail_index(name: str, want, got):
    raise IndexError(expected(name, want, got))


def fail_type(name: str, want, got):
    raise TypeError(expected(name, want, got))


def check_choice(name: str, value, choices, show=str):
    """``value`` itself when it is one of ``choices``, else ValueError listing them."""
    if value not in choices:
        fail(name, "one of " + ", ".join(show(c) for c in choices), show(value))
    return value


def check_range(name: str, value: int, lo: int | None = None, hi: int | None = None, why: str = ""):
    """``value`` when lo <= value <= hi (either bound may be None), else ValueError."""
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        want = (f">= {lo}" if hi is None else f"<= {hi}" if lo is None else f"in [{lo}, {hi}]") + why
        fail(name, want, value)
    return value
