"""The one vocabulary for argument errors: `name: expected X, got Y`.

    raise expected("top_p", "a number in (0, 1]", 0)   # top_p: expected a number in (0, 1], got 0

Shared by SamplingParams, StructuredOutputsParams and the server; `got` is a
short_repr, so a client's huge or deeply nested value never reaches repr() whole.
"""

from __future__ import annotations

import reprlib

from paged.backends.arg_checks import expected as message  # the one message builder, backends included

_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother = 3, 60, 60


def short_repr(value, limit: int = 80) -> str:
    """A repr for error messages: one short line, and cheap and safe for any
    value (reprlib stops at 3 levels and a few items)."""
    s = _REPR.repr(value)
    return s if len(s) <= limit else s[: limit - 3] + "..."


def expected(name: str, what: str, value) -> ValueError:
    return ValueError(message(name, what, short_repr(value)))
