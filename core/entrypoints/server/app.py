"""The OpenAI-compatible HTTP app (FastAPI).

    app = create_app(aengine, tokenizer, ServerConfig(model_name=..., max_model_len=...))

Every error leaves as OpenAI's JSON (server/errors.py); bad input is a 400
naming the field, never a 422 or a 500. Bodies are read and checked by
server/body.py and validated by the models of server/protocol.py, which
/openapi.json publishes (server/openapi.py).

No request can stall the others: parsing bodies, tokenizing, chat
templates and decoding run on a small thread pool (the tokenizer releases
the GIL), and a text prompt longer than max_model_len x the longest token's
characters, which can never fit, is refused before any of that work.
Structured-output constraints are compiled on the engine's grammar thread
before the request is submitted, so a bad schema is a 400 and a slow one
holds up only its own request.

GET / is a web page (a chat and the engine's live state, server/web.py)
fed by the API and GET /v1/engine/state (server/live.py).

Tools (chat): rendered by the model's template when it knows them, else in
the Hermes fallback (core/entrypoints/tools.py); calls are parsed out of the output
(core/entrypoints/tool_parser.py), streamed as OpenAI tool_call deltas.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from paged.core.entrypoints.async_engine import AsyncEngine, EngineShutdownError, QueueFullError
from paged.core.engine.sampling_params import SamplingParams, StructuredOutputsParams
from paged.core.entrypoints.server import protocol as P
from paged.core.entrypoints.server.body import decode, read_body
from paged.core.entrypoints.server.errors import APIError, api_error_from, bad_request, expected, install_handlers, param_named_in
from paged.core.entrypoints.server.metrics import ServerMetrics
from paged.core.entrypoints.server.openapi import ERROR_RESPONSES, add_schema_routes
from paged.core.entrypoints.server.structured import chat_delta, chat_message, request_constraint
from paged.core.entrypoints.server.web import STATE_PATH, add_web_routes
from paged.core.entrypoints.tool_parser import ToolCallStream
from paged.core.entrypoints.tools import Tool, fallback_messages, native_messages, template_renders_tools

#: tokenizer threads: enough that one long prompt does not hold up the rest,
#: few enough not to crowd the engine's cores
TOKENIZER_THREADS = 2


@dataclass
class ServerConfig:
    model_name: str
    max_model_len: int
    vocab_size: int
    api_key: Optional[str] = None
    max_body_bytes: int = 8 * 2**20
    model_root: str = ""  # where the model lives: logged by the CLI, never published
    # how often a non-streaming request checks that its client is still there
    disconnect_poll_s: float = 0.2


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
        self.pool = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="paged-tokenize")
        self.longest_token = tokenizer.longest_token_chars()
        self.max_prompt_chars = config.max_model_len * self.longest_token
        self.native_tools = template_renders_tools(getattr(tokenizer, "chat_template", None))

    # -- request plumbing ----------------------------------------------------
    def check_auth(self, request: Request) -> None:
        key = self.config.api_key
        if not key:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        # constant time: the comparison must not tell how much of a guess was right
        if not (scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())):
            raise APIError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                           "authentication_error", None, "invalid_api_key")

    async def read(self, request: Request, path: str):
        raw = await read_body(request, self.config.max_body_bytes)
        return await self.off_loop(decode, raw, P.REQUEST_BODIES[path])

    async def off_loop(self, fn, *args, **kwargs):
        """fn on the tokenizer pool: the event loop keeps serving meanwhile."""
        call = functools.partial(fn, *args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(self.pool, call)

    def check_chars(self, n_chars: int, param: str) -> None:
        """Text longer than this can never fit max_model_len tokens: refuse it
        before spending tokenizer time on it."""
        if n_chars > self.max_prompt_chars:
            raise expected(param, f"at most {self.max_prompt_chars} characters (max_model_len "
                                  f"{self.config.max_model_len} x {self.longest_token}, the longest token)",
                           f"{n_chars}", param)

    def check_model(self, name: Optional[str]) -> None:
        if name is not None and name != self.config.model_name:
            raise APIError(404, f"model: expected {self.config.model_name!r} (the served model), got {name!r}",
                           "invalid_request_error", "model", "model_not_found")

    def prompt_ids(self, prompt, param: str = "prompt") -> list[int]:
        """Token ids of a text or token-id prompt (runs on the pool)."""
        if isinstance(prompt, str):
            ids = list(self.tokenizer.encode(prompt))
        else:
            ids = self.check_token_ids(prompt, param)
        if not ids:
            raise expected(param, "a prompt of at least one token", repr(prompt), param)
        return ids

    def check_token_ids(self, ids: list[int], param: str) -> list[int]:
        vocab = self.config.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise expected(param, f"token ids in [0, {vocab})", str(bad), param)
        return list(ids)

    def check_group(self, prompts: list) -> None:
        """More prompts than the waiting queue holds could never be admitted:
        a 400, not the 503 that says retry."""
        limit = self.aengine.max_waiting
        if limit is not None and len(prompts) > limit:
            raise expected("prompt", f"at most {limit} prompts per request (--max-waiting-requests)",
                           str(len(prompts)), "prompt")
        for p in prompts:
            if isinstance(p, str):
                self.check_chars(len(p), "prompt")

    def max_tokens_for(self, n_prompt: int, requested: Optional[int], param: str) -> int:
        max_len = self.config.max_model_len
        if n_prompt >= max_len:
            prompt = "prompt" if param == "max_tokens" else "messages"
            raise expected(prompt, f"fewer than {max_len} tokens (max_model_len; one more is generated)",
                           f"{n_prompt} tokens", prompt)
        if requested is None:
            return max_len - n_prompt
        if n_prompt + requested > max_len:
            raise expected(param, f"at most {max_len - n_prompt} (max_model_len {max_len} - {n_prompt} prompt "
                                  "tokens)", str(requested), param)
        return requested

    def sampling_params(self, req: P.SamplingFields, max_tokens: int, logprobs: Optional[int],
                        constraint: Optional[StructuredOutputsParams] = None) -> SamplingParams:
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
                include_stop_str_in_output=req.include_stop_str_in_output,
                logit_bias=req.logit_bias_ids(),
                structured_outputs=constraint,
            )
            params.validate_for_vocab(self.config.vocab_size)
        except ValueError as exc:
            raise bad_request(str(exc), param_named_in(str(exc), type(req))) from None
        return params

    def grammar_compiler(self):
        """The engine's (compiling here, before submitting, puts the result in
        the cache the engine admits requests from)."""
        return self.aengine.engine.grammars.compiler

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
        req: P.CompletionRequest = await self.read(request, "/v1/completions")
        self.check_model(req.model)
        prompts = req.prompts()
        self.check_group(prompts)
        ids = await self.off_loop(lambda: [self.prompt_ids(p) for p in prompts])
        texts = [p if isinstance(p, str) else None for p in prompts]
        base = P.random_id("cmpl")
        constraint = await request_constraint(self.grammar_compiler(), req)
        requests = []
        for i, tok in enumerate(ids):
            max_tokens = self.max_tokens_for(len(tok), req.max_tokens, "max_tokens")
            requests.append((f"{base}-{i}", tok, self.sampling_params(req, max_tokens, req.logprobs, constraint)))
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
    async def chat_prompt_ids(self, messages: list[P.ChatMessage], add_generation_prompt: bool = True,
                              tools: Optional[list[Tool]] = None) -> list[int]:
        self.check_chars(sum(len(m.text()) for m in messages), "messages")
        return await self.off_loop(self._render_chat, [m.for_template() for m in messages], add_generation_prompt,
                                   tools)

    def _with_tools(self, conv: list[dict], tools: Optional[list[Tool]]) -> tuple[list[dict], dict]:
        """The conversation and template arguments with tools and tool turns
        rendered: by the template when it knows tools, else the fallback."""
        if not tools and not any(m.get("tool_calls") or m["role"] == "tool" for m in conv):
            return conv, {}
        if self.native_tools:
            return native_messages(conv), {"tools": [t.openai() for t in tools]} if tools else {}
        return fallback_messages(conv, tools), {}

    def _render_chat(self, conv: list[dict], add_generation_prompt: bool,
                     tools: Optional[list[Tool]] = None) -> list[int]:
        conv, extra = self._with_tools(conv, tools)
        try:
            text = self.tokenizer.apply_chat_template(conv, add_generation_prompt=add_generation_prompt, **extra)
        except Exception as exc:  # noqa: BLE001 - a template that rejects the conversation
            raise bad_request(f"messages: the chat template rejected them: {exc}", "messages") from None
        # the template writes the special tokens itself
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    async def chat_completions(self, request: Request):
        req: P.ChatCompletionRequest = await self.read(request, "/v1/chat/completions")
        self.check_model(req.model)
        if req.top_logprobs is not None and not req.logprobs:
            raise expected("top_logprobs", "null unless logprobs is true", str(req.top_logprobs), "top_logprobs")
        mode, tools = req.tool_mode(), req.tool_list()
        ids = await self.chat_prompt_ids(req.messages, req.add_generation_prompt, tools if mode != "none" else None)
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = self.max_tokens_for(len(ids), req.effective_max_tokens(), param)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        forced = req.forced_tools()  # a named function is called once; "required" may call several
        parallel = mode == "required" and req.parallel_tool_calls is not False
        constraint = await request_constraint(self.grammar_compiler(), req, forced, parallel)
        rid = P.random_id("chatcmpl")
        group = self.submit([(rid, ids, self.sampling_params(req, max_tokens, logprobs, constraint))])
        names = {t.name for t in tools} if mode != "none" else None
        if req.stream:
            return self.sse(self.chat_chunks(req, rid, group, names), group)
        final = (await self.collect(request, group))[rid]
        choices = []
        for o in final.outputs:
            message, finish = chat_message(o, names)
            choices.append({
                "index": o.index,
                "message": message,
                "logprobs": {"content": self.chat_logprobs(o.token_ids, o.logprobs, 0, req.top_logprobs or 0)}
                if req.logprobs else None,
                "finish_reason": finish,
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

    async def chat_chunks(self, req, rid, group, names: Optional[set[str]] = None):
        created, model = P.now(), self.config.model_name
        head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
        for i in range(req.n):
            yield {**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                        "logprobs": None, "finish_reason": None}]}
        sent_text: dict[int, int] = {}
        sent_tokens: dict[int, int] = {}
        streams = [ToolCallStream(names) for _ in range(req.n)] if names is not None else None
        n_prompt = n_out = 0
        async for out in group:
            for o in out.outputs:
                start_text, start_tok = sent_text.get(o.index, 0), sent_tokens.get(o.index, 0)
                delta, finish = chat_delta(o, start_text, streams[o.index] if streams else None)
                if not delta and o.finish_reason is None:
                    continue
                sent_text[o.index], sent_tokens[o.index] = len(o.text), len(o.token_ids)
                choice = {"index": o.index, "delta": delta,
                          "logprobs": None, "finish_reason": finish, "stop_reason": o.stop_reason}
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
    def engine_state(self) -> dict:
        """GET /v1/engine/state: what the web page shows (server/live.py)."""
        return self.metrics.live.state(self.aengine.stats(), self.aengine.num_in_flight, self.config.model_name,
                                       self.config.max_model_len, self.metrics.totals())

    def models(self) -> dict:
        # the name only: where the model lives on disk is none of a client's business
        name = self.config.model_name
        return {"object": "list", "data": [{
            "id": name, "object": "model", "created": self.created, "owned_by": "paged", "root": name,
            "parent": None, "max_model_len": self.config.max_model_len}]}

    async def tokenize(self, request: Request) -> dict:
        req: P.TokenizeRequest = await self.read(request, "/tokenize")
        self.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            given = "both" if req.prompt is not None else "neither"
            raise expected("prompt", "exactly one of prompt or messages", given, "prompt")
        if req.prompt is not None:
            self.check_chars(len(req.prompt), "prompt")
            ids = await self.off_loop(self.tokenizer.encode, req.prompt, add_special_tokens=req.add_special_tokens)
        else:
            ids = await self.chat_prompt_ids(req.messages, req.add_generation_prompt)
        return {"count": len(ids), "max_model_len": self.config.max_model_len, "tokens": list(ids)}

    async def detokenize(self, request: Request) -> dict:
        req: P.DetokenizeRequest = await self.read(request, "/detokenize")
        self.check_model(req.model)
        ids = self.check_token_ids(req.tokens, "tokens")
        text = await self.off_loop(self.tokenizer.decode, ids, skip_special_tokens=False)
        return {"prompt": text}


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
            server.pool.shutdown(wait=False, cancel_futures=True)

    # redirect_slashes off: Starlette built the redirect's Location from the
    # Host header, so a forged Host sent clients elsewhere; "/x/" is a 404
    app = FastAPI(title="paged", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None,
                  redirect_slashes=False)
    app.state.server = server
    install_handlers(app)
    guarded_paths = set(P.REQUEST_BODIES) | {"/v1/models", STATE_PATH}

    def guarded(handler):
        async def endpoint(request: Request):
            server.check_auth(request)
            return await handler(request)
        endpoint.__name__ = handler.__name__
        endpoint.__doc__ = handler.__doc__
        return endpoint

    for path, handler in (("/v1/completions", server.completions), ("/v1/chat/completions", server.chat_completions),
                          ("/tokenize", server.tokenize), ("/detokenize", server.detokenize)):
        app.add_api_route(path, guarded(handler), methods=["POST"], responses=ERROR_RESPONSES)

    async def models(request: Request):
        return server.models()

    app.add_api_route("/v1/models", guarded(models), methods=["GET"], responses={401: ERROR_RESPONSES[401]})
    add_web_routes(app, guarded, server.engine_state)
    add_schema_routes(app, config.model_name, guarded_paths, server.check_auth, secured=bool(config.api_key))

    @app.get("/health")
    async def health():
        if not aengine.healthy:
            return JSONResponse({"status": "unavailable"}, status_code=503)
        return {"status": "ok"}

    @app.get("/version")
    async def version():
        from paged import __version__

        return {"version": __version__}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics_endpoint():
        text = server.metrics.render(aengine.stats(), aengine.num_in_flight)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    return app
