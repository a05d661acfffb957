"""Request bodies: read under a size cap (read_body), then parse, check and
validate (decode).

Bodies are read by hand (not by FastAPI) so the size cap holds while
reading and any Content-Type is taken as JSON (`curl -d` sends a form
type). Before pydantic sees the data, the JSON itself is held to what the
rest of the server can take: standard JSON only (no NaN / Infinity), no
nesting so deep the parser raises RecursionError (it was a 500), and valid
Unicode text (a lone surrogate such as "\\ud800" made the tokenizer raise
TypeError, a 500). Nothing walks the data but for that last check, and only
when the raw body has a surrogate escape. Deep values never reach repr()
whole (argcheck.short_repr).
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from paged.core.entrypoints.server.errors import APIError, expected, field_path, from_validation

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")

M = TypeVar("M", bound=BaseModel)
log = logging.getLogger("paged.server")


def decode(raw: bytes, model: type[M]) -> M:
    """Parse, check and validate a body (CPU work: the server runs it off
    the event loop)."""
    data = parse(raw)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise from_validation(exc) from None


async def read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit, f"{int(declared)} bytes")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _too_large(limit, "more")
            chunks.append(chunk)
    except ClientDisconnect:
        # nothing was submitted yet: dropping the chunks frees all; a client
        # going away is routine, not a traceback
        log.debug("%s %s: the client disconnected while sending its body (%d bytes read)",
                  request.method, request.url.path, size)
        raise APIError(499, "client disconnected while sending the body", "client_closed_request") from None
    return b"".join(chunks)


def _too_large(limit: int, got: str) -> APIError:
    return APIError(413, f"body: expected at most {limit} bytes (the --max-body-size limit), got {got}",
                    "invalid_request_error", None, "request_too_large")


def _not_json(token: str):
    raise ValueError(f"{token} (not a JSON number)")


def parse(raw: bytes) -> dict[str, Any]:
    try:
        data = json.loads(raw or b"null", parse_constant=_not_json)
    except RecursionError:
        raise expected("body", "JSON nested less deeply (the parser stops near 1000 levels)",
                       "deeper nesting") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, NaN / Infinity, huge integers
        raise expected("body", "valid JSON", str(exc).splitlines()[0][:200]) from None
    if not isinstance(data, dict):
        raise expected("body", "a JSON object", type(data).__name__)
    _check_text(data, raw)
    return data


def _check_text(data: Any, raw: bytes) -> None:
    """A lone surrogate can only arrive as a \\uD800-\\uDFFF escape (UTF-8
    cannot carry one), so bodies without such an escape skip the walk."""
    if not _SURROGATE_ESCAPE.search(raw):
        return
    stack: list[tuple[Any, tuple]] = [(data, ())]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str) and not _valid_text(value):
            char = next(c for c in value if 0xD800 <= ord(c) <= 0xDFFF)
            raise expected(field_path(path), "valid Unicode text", f"a lone surrogate U+{ord(char):04X}",
                           str(path[0]) if path else None)
        if isinstance(value, dict):
            stack.extend((k, path) for k in value)
            stack.extend((v, path + (k,)) for k, v in value.items())
        elif isinstance(value, list):
            stack.extend((v, path + (i,)) for i, v in enumerate(value))


def _valid_text(text: str) -> bool:
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False
