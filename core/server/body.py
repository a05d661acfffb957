"""Request bodies: read under a size cap, parse, check, validate.

Bodies are read by hand (not by FastAPI) so the size cap holds while
reading and any Content-Type is taken as JSON (`curl -d` sends a form
type). Before pydantic sees the data, the JSON itself is held to what the
rest of the server can take: standard JSON only (no NaN / Infinity), at
most MAX_DEPTH levels of nesting (deeper input made json / pydantic raise
RecursionError, a 500), and valid Unicode text (a lone surrogate such as
"\\ud800" made the tokenizer raise TypeError, a 500).
"""

from __future__ import annotations

import json
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from paged.core.server.errors import APIError, expected, field_path, from_validation

#: deeper than any OpenAI request (messages -> parts -> fields is 4)
MAX_DEPTH = 32

M = TypeVar("M", bound=BaseModel)


async def read_json(request: Request, model: type[M], limit: int) -> M:
    data = parse(await _read(request, limit))
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise from_validation(exc) from None


async def _read(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit, f"{int(declared)} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit, "more")
        chunks.append(chunk)
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
        raise _too_deep() from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, NaN / Infinity, huge integers
        raise expected("body", "valid JSON", str(exc).splitlines()[0][:200]) from None
    if not isinstance(data, dict):
        raise expected("body", "a JSON object", type(data).__name__)
    check_values(data)
    return data


def _too_deep() -> APIError:
    return expected("body", f"JSON nested at most {MAX_DEPTH} levels deep", "deeper nesting")


def check_values(data: Any) -> None:
    """Depth and text checks over the parsed JSON, without recursion."""
    stack: list[tuple[Any, tuple, int]] = [(data, (), 0)]
    while stack:
        value, path, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise _too_deep()
        if isinstance(value, str):
            _check_text(value, path)
        elif isinstance(value, dict):
            for key, item in value.items():
                _check_text(key, path)
                stack.append((item, path + (key,), depth + 1))
        elif isinstance(value, list):
            stack.extend((item, path + (i,), depth + 1) for i, item in enumerate(value))


def _check_text(text: str, path: tuple) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = f"a lone surrogate U+{ord(text[exc.start]):04X}"
        raise expected(field_path(path), "valid Unicode text", bad, str(path[0]) if path else None) from None
