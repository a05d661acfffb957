"""The API's errors: one OpenAI-shaped JSON body for every failure.

    {"error": {"message": "max_tokens: expected a value >= 1, got 0",
               "type": "invalid_request_error", "param": "max_tokens", "code": "invalid_parameter"}}

Messages follow the project's vocabulary, `name: expected X, got Y`, on one
line. Client errors are answered here and never logged with a traceback;
only real bugs reach Starlette's catch-all (logged, 500).
"""

from __future__ import annotations

from typing import Optional

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from paged.core.entrypoints.async_engine import EngineShutdownError, EngineStepError, QueueFullError
from paged.core.argcheck import message
from paged.core.argcheck import short_repr
from paged.core.engine.scheduler import WaitingQueueFull


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code if self.code is not None else self.status}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def bad_request(message: str, param: Optional[str] = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, "invalid_parameter")


def expected(name: str, what: str, got: str, param: Optional[str] = None) -> APIError:
    """A 400 in the vocabulary; `got` is already described for the reader."""
    return bad_request(message(name, what, got), param)


_TOO_SHORT = {"too_short": "item(s)", "string_too_short": "character(s)"}
_BOUNDS = {"greater_than": ("gt", ">"), "greater_than_equal": ("ge", ">="),
           "less_than": ("lt", "<"), "less_than_equal": ("le", "<=")}


def field_path(loc: tuple) -> str:
    """('messages', 0, 'role') -> 'messages[0].role'."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "body"


def _one(err: dict) -> str:
    where = field_path(err.get("loc", ()))
    if err["type"] == "missing":
        return message(where, "a value", "nothing")
    if err["type"] in _BOUNDS:
        key, op = _BOUNDS[err["type"]]
        what = f"a value {op} {err['ctx'][key]}"
    elif err["type"] in _TOO_SHORT:
        what = f"at least {err['ctx']['min_length']} {_TOO_SHORT[err['type']]}"
    else:
        what = err["msg"].removeprefix("Input should be ").removeprefix("expected ")
    return message(where, what, short_repr(err.get("input")))


def param_named_in(message: str, model: type) -> Optional[str]:
    """The request field an error message starts with ('guided_json: ...',
    'tools[0].function.name: ...'), when the model has it."""
    name = message.partition(":")[0].partition(".")[0].partition("[")[0]
    return name if name in model.model_fields else None


def from_validation(exc: ValidationError) -> APIError:
    """pydantic's errors as one line naming the fields (param: the first)."""
    errors = exc.errors()
    loc = errors[0].get("loc", ()) if errors else ()
    more = f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""
    return bad_request("; ".join(_one(e) for e in errors[:3]) + more, str(loc[0]) if loc else None)


def api_error_from(exc: BaseException) -> APIError:
    """The HTTP error a failure maps to (also used inside SSE streams)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, (QueueFullError, WaitingQueueFull)):
        return APIError(503, str(exc), "server_overloaded", None, "queue_full")
    if isinstance(exc, EngineShutdownError):
        return APIError(503, str(exc), "server_shutting_down", None, "shutting_down")
    if isinstance(exc, EngineStepError):
        return APIError(500, str(exc), "internal_error", None, "engine_error")
    if isinstance(exc, ValueError):  # the engine rejected the request's values
        return bad_request(str(exc))
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}", "internal_error")


def install_handlers(app: FastAPI) -> None:
    async def known(request, exc: Exception):
        return api_error_from(exc).response()

    # expected failures get their own handlers (the catch-all Exception one
    # is for real bugs: Starlette logs a traceback for those)
    for cls in (APIError, QueueFullError, WaitingQueueFull, EngineShutdownError, EngineStepError, ValueError,
                Exception):
        app.add_exception_handler(cls, known)

    @app.exception_handler(RequestValidationError)
    async def _validation(request, exc: RequestValidationError):
        return bad_request(f"invalid request: {short_repr(exc.errors(), 300)}").response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        response = APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", kind).response()
        response.headers.update(exc.headers or {})  # a 405's Allow: the methods the route takes
        return response
