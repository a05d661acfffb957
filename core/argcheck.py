"""The one vocabulary for argument errors: `name: expected X, got Y`.

    raise expected("top_p", "a number in (0, 1]", 0)   # top_p: expected a number in (0, 1], got 0
    fail("block_size", "a positive integer", 0)         # raises the same shape from a backend

Every message has that shape, in Python (here) and in C++ (csrc_shared/
arg_error.h), so a user reads one format whatever rejected the call. The
exception type says what went wrong: ValueError for a bad shape / dtype /
device / value, IndexError for an id outside its range, TypeError for
something that is not a tensor. `expected` shows `got` as a short_repr, so a
client's huge or deeply nested value never reaches repr() whole.
"""

from __future__ import annotations

import reprlib

_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother = 3, 60, 60


def message(name: str, want, got) -> str:
    """The message: ``name: expected want, got got``."""
    return f"{name}: expected {want}, got {got}"


def short_repr(value, limit: int = 80) -> str:
    """A repr for error messages: one short line, and cheap and safe for any
    value (reprlib stops at 3 levels and a few items)."""
    s = _REPR.repr(value)
    return s if len(s) <= limit else s[: limit - 3] + "..."


def expected(name: str, what: str, value) -> ValueError:
    """The ValueError for a value from a user (its repr kept short)."""
    return ValueError(message(name, what, short_repr(value)))


def fail(name: str, want, got):
    raise ValueError(message(name, want, got))


def fail_index(name: str, want, got):
    raise IndexError(message(name, want, got))


def fail_type(name: str, want, got):
    raise TypeError(message(name, want, got))


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
