"""The web page at / : a chat and the engine's live state, in one static page.

The files under static/ are the whole page: plain HTML, CSS and JavaScript,
no build step and nothing fetched from elsewhere, so it works offline. The
page is open (it holds no data); what it shows comes from the API behind
--api-key: /v1/models, /v1/chat/completions (stream=true) and
GET /v1/engine/state (server/live.py), which the page polls once a second.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse

from paged.core.entrypoints.server.live import EngineState
from paged.core.entrypoints.server.openapi import ERROR_RESPONSES

STATIC = Path(__file__).parent / "static"
_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
          ".css": "text/css; charset=utf-8"}
# the page runs only its own files: no inline script, no other origin
_HEADERS = {"Content-Security-Policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'",
            "X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache"}
STATE_PATH = "/v1/engine/state"


def add_web_routes(app: FastAPI, guarded: Callable, engine_state: Callable[[], dict]) -> None:
    """GET / (the page), GET /static/<file> and GET /v1/engine/state
    (`guarded`: wraps a handler with the API-key check)."""
    def static_file(path: Path):
        async def serve(request: Request) -> FileResponse:
            return FileResponse(path, media_type=_TYPES[path.suffix], headers=_HEADERS)
        return serve

    app.add_api_route("/", static_file(STATIC / "index.html"), methods=["GET"], include_in_schema=False)
    for path in sorted(STATIC.iterdir()):
        if path.suffix in _TYPES and path.name != "index.html":
            app.add_api_route(f"/static/{path.name}", static_file(path), methods=["GET"], include_in_schema=False)

    async def state(request: Request) -> dict:
        """The engine now and over the last minutes: what the web page shows."""
        return engine_state()

    state.__name__ = "engine_state"
    app.add_api_route(STATE_PATH, guarded(state), methods=["GET"], response_model=EngineState,
                      responses={401: ERROR_RESPONSES[401]}, summary="Engine state")
