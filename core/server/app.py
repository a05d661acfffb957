"""The OpenAI-compatible HTTP app (FastAPI).

    app = create_app(aengine, tokenizer, ServerConfig(model_name=..., max_model_len=...))

Every error leaves as OpenAI's JSON ({"error": {message, type, param,
code}}); bad input is a 4xx naming the field, never a 422 or a 500.
Bodies are read by hand so their size can be capped while reading.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass
from typing import Any, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from paged.core.async_engine import AsyncEngine, EngineShutdownError, EngineStepError, QueueFullError
from paged.core.sampling_params import SamplingParams
from paged.core.scheduler import WaitingQueueFull
from paged.core.server import protocol as P
from paged.core.server.metrics import ServerMetrics


@dataclass
class ServerConfig:
    model_name: str
    max_model_len: int
    vocab_size: int
    api_key: Optional[str] = None
    max_body_bytes: int = 8 * 2**20
    model_root: str = ""
    # how often a non-streaming request checks that its client is still there
    disconnect_poll_s: float = 0.2


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


def _bad_request(message: str, param: Optional[str] = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, "invalid_parameter")


def _validation_error(exc: ValidationError) -> APIError:
    parts, param = [], None
    for err in exc.errors():
        loc = ".".join(str(x) for x in err.get("loc", ()))
        param = param or (str(err["loc"][0]) if err.get("loc") else None)
        parts.append(f"{loc or 'body'}: {err.get('msg')} (got {_short(err.get('input'))})")
    return _bad_request("invalid request: " + "; ".join(parts), param)


def _short(v: Any, limit: int = 80) -> str:
    s = repr(v)
    return s if len(s) <= limit else s[: limit - 3] + "..."


def _param_named_in(message: str, model: type[BaseModel]) -> Optional[str]:
    names = sorted(model.model_fields, key=len, reverse=True)
    return next((n for n in names if message.startswith(n) or f" {n} " in f" {message} "), None)


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
        return _bad_request(str(exc))
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}", "internal_error")


class OpenAIServer:
    """The handlers, holding what they share (engine, tokenizer, config)."""

    def __init__(self, aengine: AsyncEngine, tokenizer: Any, config: ServerConfig,
                 metrics: Optional[ServerMetrics] = None):
        self.aengine = aengine
        self.tokenizer = tokenizer
        self.config = config
        self.metrics = metrics or ServerMetrics(config.model_name)
        if aengine.observer is None:
            aengine.observer = self.metrics
        self.created = int(time.time())

    # -- request plumbing ----------------------------------------------------
    def check_auth(self, request: Request) -> None:
        key = self.config.api_key
        if not key:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or token.strip() != key:
            raise APIError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                           "authentication_error", None, "invalid_api_key")

    async def read_json(self, request: Request, model: type[BaseModel]):
        limit = self.config.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise APIError(413, f"request body of {int(declared)} bytes exceeds the {limit}-byte limit",
                           "invalid_request_error", None, "request_too_large")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise APIError(413, f"request body exceeds the {limit}-byte limit",
                               "invalid_request_error", None, "request_too_large")
            chunks.append(chunk)
        try:
            data = json.loads(b"".join(chunks) or b"null")
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise _bad_request(f"request body is not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise _bad_request(f"request body must be a JSON object, got {type(data).__name__}")
        try:
            return model.model_validate(data)
        except ValidationError as exc:
            raise _validation_error(exc) from None

    def check_model(self, name: Optional[str]) -> None:
        if name is not None and name != self.config.model_name:
            raise APIError(404, f"model {name!r} does not exist; this server serves {self.config.model_name!r}",
                           "invalid_request_error", "model", "model_not_found")

    def prompt_ids(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt))
        vocab = self.config.vocab_size
        bad = next((t for t in prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise _bad_request(f"prompt token id {bad} is outside the vocabulary [0, {vocab})", "prompt")
        return list(prompt)

    def max_tokens_for(self, n_prompt: int, requested: Optional[int], param: str) -> int:
        max_len = self.config.max_model_len
        if n_prompt >= max_len:
            raise _bad_request(
                f"the prompt has {n_prompt} tokens but this model's maximum context length is {max_len} tokens",
                "prompt" if param == "max_tokens" else "messages")
        if requested is None:
            return max_len - n_prompt
        if n_prompt + requested > max_len:
            raise _bad_request(
                f"this model's maximum context length is {max_len} tokens; the prompt has {n_prompt} tokens "
                f"and {param} is {requested} ({n_prompt + requested} in all)", param)
        return requested

    def sampling_params(self, req: P.SamplingFields, max_tokens: int, logprobs: Optional[int]) -> SamplingParams:
        try:
            params = SamplingParams(
                n=req.n,
                temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p,
                top_k=0 if req.top_k is None else req.top_k,
                min_p=req.min_p,
                repetition_penalty=req.repetition_penalty,
                presence_penalty=req.presence_penalty,
                frequency_penalty=req.frequency_penalty,
                seed=req.seed,
                max_tokens=max_tokens,
                min_tokens=req.min_tokens,
                stop=req.stop,
                stop_token_ids=req.stop_token_ids,
                ignore_eos=req.ignore_eos,
                logprobs=logprobs,
                skip_special_tokens=req.skip_special_tokens,
            )
            params.validate_for_vocab(self.config.vocab_size)
        except ValueError as exc:
            raise _bad_request(str(exc), _param_named_in(str(exc), type(req))) from None
        return params

    def submit(self, requests):
        try:
            return self.aengine.submit(requests)
        except (QueueFullError, EngineShutdownError) as exc:
            self.metrics.on_rejected()
            raise api_error_from(exc) from None

    async def collect(self, request: Request, group) -> dict[str, Any]:
        """Run a group to the end (non-streaming), aborting it when the
        client goes away. Returns request_id -> final RequestOutput."""
        final: dict[str, Any] = {}

        async def drain():
            async for out in group:
                final[out.request_id] = out

        task = asyncio.ensure_future(drain())
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=self.config.disconnect_poll_s)
                if done:
                    task.result()
                    return final
                if await request.is_disconnected():
                    task.cancel()
                    raise APIError(499, "client disconnected", "client_closed_request")
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
            group.close()

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    # -- /v1/completions -----------------------------------------------------
    async def completions(self, request: Request):
        req: P.CompletionRequest = await self.read_json(request, P.CompletionRequest)
        self.check_model(req.model)
        if req.suffix:
            raise _bad_request("suffix is not supported", "suffix")
        prompts = req.prompts()
        ids = [self.prompt_ids(p) for p in prompts]
        texts = [p if isinstance(p, str) else None for p in prompts]
        base = P.random_id("cmpl")
        requests = []
        for i, tok in enumerate(ids):
            max_tokens = self.max_tokens_for(len(tok), req.max_tokens, "max_tokens")
            requests.append((f"{base}-{i}", tok, self.sampling_params(req, max_tokens, req.logprobs)))
        group = self.submit(requests)
        index_base = {rid: i * req.n for i, (rid, _, _) in enumerate(requests)}
        prompt_text = {rid: texts[i] for i, (rid, _, _) in enumerate(requests)}
        prompt_ids = {rid: ids[i] for i, (rid, _, _) in enumerate(requests)}
        echo_text = (lambda rid: prompt_text[rid] if prompt_text[rid] is not None
                     else self.tokenizer.decode(prompt_ids[rid]))
        if req.stream:
            return self.sse(self.completion_chunks(req, base, group, index_base, echo_text), group)
        final = await self.collect(request, group)
        choices, n_prompt, n_out = [], 0, 0
        for rid, out in final.items():
            n_prompt += len(out.prompt_token_ids)
            for o in out.outputs:
                n_out += len(o.token_ids)
                text = (echo_text(rid) if req.echo else "") + o.text
                choices.append({
                    "index": index_base[rid] + o.index,
                    "text": text,
                    "logprobs": self.completion_logprobs(o.token_ids, o.logprobs, 0) if req.logprobs is not None
                    else None,
                    "finish_reason": o.finish_reason,
                    "stop_reason": o.stop_reason,
                })
        choices.sort(key=lambda c: c["index"])
        return {"id": base, "object": "text_completion", "created": P.now(), "model": self.config.model_name,
                "choices": choices, "usage": P.usage(n_prompt, n_out)}

    def completion_logprobs(self, token_ids, logprobs, start: int, text_offset: int = 0) -> dict:
        tokens, token_lps, tops, offsets = [], [], [], []
        for tok, lp in zip(token_ids[start:], (logprobs or [])[start:]):
            s = self.token_text(tok)
            tokens.append(s)
            token_lps.append(lp.get(tok))
            tops.append({self.token_text(t): v for t, v in lp.items()})
            offsets.append(text_offset)
            text_offset += len(s)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    async def completion_chunks(self, req, base, group, index_base, echo_text):
        created, model = P.now(), self.config.model_name
        sent_text: dict[int, int] = {}
        sent_tokens: dict[int, int] = {}
        n_prompt = n_out = 0
        async for out in group:
            for o in out.outputs:
                idx = index_base[out.request_id] + o.index
                first = idx not in sent_text
                start_text, start_tok = sent_text.get(idx, 0), sent_tokens.get(idx, 0)
                delta = o.text[start_text:]
                if req.echo and first:
                    delta = echo_text(out.request_id) + delta
                if not delta and o.finish_reason is None and not first:
                    continue
                sent_text[idx], sent_tokens[idx] = len(o.text), len(o.token_ids)
                choice = {"index": idx, "text": delta, "logprobs": None,
                          "finish_reason": o.finish_reason, "stop_reason": o.stop_reason}
                if req.logprobs is not None:
                    choice["logprobs"] = self.completion_logprobs(o.token_ids, o.logprobs, start_tok, start_text)
                yield {"id": base, "object": "text_completion", "created": created, "model": model,
                       "choices": [choice]}
            if out.finished:
                n_prompt += len(out.prompt_token_ids)
                n_out += sum(len(o.token_ids) for o in out.outputs)
        if req.stream_options and req.stream_options.include_usage:
            yield {"id": base, "object": "text_completion", "created": created, "model": model,
                   "choices": [], "usage": P.usage(n_prompt, n_out)}

    # -- /v1/chat/completions ------------------------------------------------
    def chat_prompt_ids(self, messages: list[P.ChatMessage], add_generation_prompt: bool = True) -> list[int]:
        try:
            conv = [{"role": m.role, "content": m.text()} for m in messages]
        except ValueError as exc:
            raise _bad_request(str(exc), "messages") from None
        try:
            text = self.tokenizer.apply_chat_template(conv, add_generation_prompt=add_generation_prompt)
        except Exception as exc:  # noqa: BLE001 - a template that rejects the conversation
            raise _bad_request(f"the chat template rejected the messages: {exc}", "messages") from None
        # the template writes the special tokens itself
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    async def chat_completions(self, request: Request):
        req: P.ChatCompletionRequest = await self.read_json(request, P.ChatCompletionRequest)
        self.check_model(req.model)
        if req.top_logprobs is not None and not req.logprobs:
            raise _bad_request("top_logprobs requires logprobs: true", "top_logprobs")
        ids = self.chat_prompt_ids(req.messages, req.add_generation_prompt)
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = self.max_tokens_for(len(ids), req.effective_max_tokens(), param)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        rid = P.random_id("chatcmpl")
        group = self.submit([(rid, ids, self.sampling_params(req, max_tokens, logprobs))])
        if req.stream:
            return self.sse(self.chat_chunks(req, rid, group), group)
        final = (await self.collect(request, group))[rid]
        choices = []
        for o in final.outputs:
            choices.append({
                "index": o.index,
                "message": {"role": "assistant", "content": o.text},
                "logprobs": {"content": self.chat_logprobs(o.token_ids, o.logprobs, 0, req.top_logprobs or 0)}
                if req.logprobs else None,
                "finish_reason": o.finish_reason,
                "stop_reason": o.stop_reason,
            })
        n_out = sum(len(o.token_ids) for o in final.outputs)
        return {"id": rid, "object": "chat.completion", "created": P.now(), "model": self.config.model_name,
                "choices": choices, "usage": P.usage(len(final.prompt_token_ids), n_out)}

    def chat_logprobs(self, token_ids, logprobs, start: int, top: int) -> list[dict]:
        content = []
        for tok, lp in zip(token_ids[start:], (logprobs or [])[start:]):
            s = self.token_text(tok)
            ranked = sorted(lp.items(), key=lambda kv: kv[1], reverse=True)[:top]
            content.append({
                "token": s, "logprob": lp.get(tok), "bytes": list(s.encode()),
                "top_logprobs": [{"token": self.token_text(t), "logprob": v,
                                  "bytes": list(self.token_text(t).encode())} for t, v in ranked],
            })
        return content

    async def chat_chunks(self, req, rid, group):
        created, model = P.now(), self.config.model_name
        head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
        for i in range(req.n):
            yield {**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                        "logprobs": None, "finish_reason": None}]}
        sent_text: dict[int, int] = {}
        sent_tokens: dict[int, int] = {}
        n_prompt = n_out = 0
        async for out in group:
            for o in out.outputs:
                start_text, start_tok = sent_text.get(o.index, 0), sent_tokens.get(o.index, 0)
                delta = o.text[start_text:]
                if not delta and o.finish_reason is None:
                    continue
                sent_text[o.index], sent_tokens[o.index] = len(o.text), len(o.token_ids)
                choice = {"index": o.index, "delta": {"content": delta} if delta else {},
                          "logprobs": None, "finish_reason": o.finish_reason, "stop_reason": o.stop_reason}
                if req.logprobs:
                    choice["logprobs"] = {"content": self.chat_logprobs(o.token_ids, o.logprobs, start_tok,
                                                                        req.top_logprobs or 0)}
                yield {**head, "choices": [choice]}
            if out.finished:
                n_prompt = len(out.prompt_token_ids)
                n_out = sum(len(o.token_ids) for o in out.outputs)
        if req.stream_options and req.stream_options.include_usage:
            yield {**head, "choices": [], "usage": P.usage(n_prompt, n_out)}

    # -- streaming ---------------------------------------------------------
    def sse(self, chunks, group) -> StreamingResponse:
        async def body():
            try:
                async for chunk in chunks:
                    yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
            except Exception as exc:  # noqa: BLE001 - headers are sent: report in-band, OpenAI style
                yield f"data: {json.dumps(api_error_from(exc).body())}\n\n"
            finally:
                # client gone (task cancelled) or done: abort what still runs
                group.close()
            yield "data: [DONE]\n\n"

        return StreamingResponse(body(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    # -- small endpoints -----------------------------------------------------
    def models(self) -> dict:
        return {"object": "list", "data": [{
            "id": self.config.model_name, "object": "model", "created": self.created, "owned_by": "paged",
            "root": self.config.model_root or self.config.model_name, "parent": None,
            "max_model_len": self.config.max_model_len}]}

    async def tokenize(self, request: Request) -> dict:
        req: P.TokenizeRequest = await self.read_json(request, P.TokenizeRequest)
        self.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise _bad_request("give exactly one of prompt or messages", "prompt")
        if req.prompt is not None:
            ids = list(self.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens))
        else:
            ids = self.chat_prompt_ids(req.messages, req.add_generation_prompt)
        return {"count": len(ids), "max_model_len": self.config.max_model_len, "tokens": ids}

    async def detokenize(self, request: Request) -> dict:
        req: P.DetokenizeRequest = await self.read_json(request, P.DetokenizeRequest)
        self.check_model(req.model)
        ids = self.prompt_ids(req.tokens) if req.tokens else []
        return {"prompt": self.tokenizer.decode(ids, skip_special_tokens=False)}


def create_app(aengine: AsyncEngine, tokenizer: Any, config: ServerConfig,
               metrics: Optional[ServerMetrics] = None) -> FastAPI:
    server = OpenAIServer(aengine, tokenizer, config, metrics)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        aengine.start()
        try:
            yield
        finally:
            aengine.shutdown()

    app = FastAPI(title="paged", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server

    async def _error_response(request, exc: Exception):
        return api_error_from(exc).response()

    # expected failures get their own handlers (the catch-all Exception one
    # is for real bugs: Starlette logs a traceback for those)
    for cls in (APIError, QueueFullError, WaitingQueueFull, EngineShutdownError, EngineStepError, ValueError,
                Exception):
        app.add_exception_handler(cls, _error_response)

    @app.exception_handler(RequestValidationError)
    async def _validation(request, exc: RequestValidationError):
        return _bad_request(f"invalid request: {exc.errors()}").response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", kind).response()

    def guarded(handler):
        async def endpoint(request: Request):
            server.check_auth(request)
            return await handler(request)
        endpoint.__name__ = handler.__name__
        return endpoint

    app.add_api_route("/v1/completions", guarded(server.completions), methods=["POST"])
    app.add_api_route("/v1/chat/completions", guarded(server.chat_completions), methods=["POST"])
    app.add_api_route("/tokenize", guarded(server.tokenize), methods=["POST"])
    app.add_api_route("/detokenize", guarded(server.detokenize), methods=["POST"])

    async def models(request: Request):
        server.check_auth(request)
        return server.models()

    app.add_api_route("/v1/models", models, methods=["GET"])

    @app.get("/health")
    async def health():
        if not aengine.healthy:
            return JSONResponse({"status": "unavailable"}, status_code=503)
        return {"status": "ok"}

    @app.get("/version")
    async def version():
        from paged import __version__

        return {"version": __version__}

    @app.get("/metrics")
    async def metrics_endpoint():
        text = server.metrics.render(aengine.stats(), aengine.num_in_flight)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    return app
