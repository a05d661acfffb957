"""/openapi.json and /docs: the schema of what the server really accepts.

The handlers read their bodies themselves (server/body.py), so FastAPI sees
no body parameter; the request models of protocol.REQUEST_BODIES are put
into the schema here, `model` is pinned to the served name, and with
--api-key the bearer scheme is declared on the routes that need it.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse, JSONResponse
from pydantic.json_schema import models_json_schema

from paged.core.entrypoints.server import protocol as P

REF = "#/components/schemas/{model}"
#: error statuses every guarded POST route can answer
ERROR_RESPONSES = {code: {"model": P.ErrorResponse, "description": what} for code, what in (
    (400, "invalid request (the message names the field)"), (401, "missing or wrong API key"),
    (404, "unknown model"), (413, "body over --max-body-size"),
    (503, "waiting queue full, or shutting down"), (500, "the engine failed this request"))}


def build_schema(app: FastAPI, model_name: str, guarded: set[str], secured: bool) -> dict:
    from paged import __version__

    schema = get_openapi(title="paged", version=__version__, routes=app.routes,
                         description="OpenAI-compatible API of the paged serving runtime")
    _, top = models_json_schema([(m, "validation") for m in P.REQUEST_BODIES.values()], ref_template=REF)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    components.update(top["$defs"])
    for path, model in P.REQUEST_BODIES.items():
        body = {"$ref": REF.format(model=model.__name__)}
        schema["paths"][path]["post"]["requestBody"] = {"required": True,
                                                        "content": {"application/json": {"schema": body}}}
        components[model.__name__]["properties"]["model"] = {
            "anyOf": [{"type": "string", "enum": [model_name]}, {"type": "null"}],
            "description": "the served model; any other name is a 404"}
    if secured:
        schema["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        for path in guarded & set(schema["paths"]):
            for op in schema["paths"][path].values():
                op["security"] = [{"bearer": []}]
    return schema


def add_schema_routes(app: FastAPI, model_name: str, guarded: set[str], check_auth, secured: bool) -> None:
    """GET /openapi.json and /docs (Swagger UI), behind the API key if one is set."""
    cache: dict[str, dict] = {}

    async def openapi(request: Request):
        check_auth(request)
        if "schema" not in cache:
            cache["schema"] = build_schema(app, model_name, guarded, secured)
        return JSONResponse(cache["schema"])

    async def docs(request: Request) -> HTMLResponse:
        check_auth(request)
        return get_swagger_ui_html(openapi_url="/openapi.json", title="paged API")

    app.add_api_route("/openapi.json", openapi, methods=["GET"], include_in_schema=False)
    app.add_api_route("/docs", docs, methods=["GET"], include_in_schema=False)
