"""Issue 22 (server side): no request can hurt another; issue 46: what a
hostile client still found (the schema and the server disagreeing, a body
cut off mid-read).

Each test names the item it guards. A real `paged serve` process on
127.0.0.1 (test_server's shared servers) answers everything but item 2's
ordering test, which runs the app in-process so it can hold a tokenization
open and see /health answered meanwhile.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import threading

import httpx
import pytest

from test_server import shared_server
from test_server_errors import AUTH, KEY, assert_error

ERRORS_SERVER_ARGS = ("--api-key", KEY, "--max-waiting-requests", "2", "--max-num-seqs", "1",
                      "--max-body-size", "65536")


@pytest.fixture(scope="module")
def server():
    return shared_server()


@pytest.fixture(scope="module")
def keyed():
    return shared_server(*ERRORS_SERVER_ARGS)


def complete(server, body, **kw):
    return httpx.post(server.url + "/v1/completions", json={"model": server.model, **body}, timeout=120, **kw)


def chat(server, body, content="Hi", **kw):
    msgs = body.pop("messages", [{"role": "user", "content": content}])
    return httpx.post(server.url + "/v1/chat/completions", timeout=120,
                      json={"model": server.model, "messages": msgs, "max_tokens": 2, **body}, **kw)


def raw_post(server, path, data: bytes):
    return httpx.post(server.url + path, content=data, timeout=60, headers={"Content-Type": "application/json"})


def stream_lines(server, body):
    with httpx.stream("POST", server.url + "/v1/completions", json={"model": server.model, **body},
                      timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                yield json.loads(line[6:])


# -- item 1: one request kills every request in flight -------------------------


def test_item1_out_of_range_seed_is_a_400_and_the_stream_beside_it_finishes(server):
    body = {"prompt": "Count: 1, 2, 3,", "max_tokens": 60, "temperature": 0, "ignore_eos": True, "stream": True}
    chunks, bad = [], None
    for msg in stream_lines(server, body):
        chunks.append(msg)
        if bad is None:  # the stream is generating: send the request that used to kill it
            bad = complete(server, {"prompt": "hi", "max_tokens": 2, "temperature": 0.5, "seed": 2**64})
    assert_error(bad, 400, "seed", param="seed")
    assert not [c for c in chunks if "error" in c], chunks[-1]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    for seed in (2**64 - 1, -(2**63)):  # the edges torch takes are served
        assert complete(server, {"prompt": "hi", "max_tokens": 2, "temperature": 0.5, "seed": seed,
                                 "n": 2}).status_code == 200


# -- item 2: one large prompt freezes the server ---------------------------------


class GatedTokenizer:
    """The real tokenizer, but encode() waits at a gate the test opens: the
    test can look at the server while a tokenization is in progress."""

    def __init__(self, tokenizer):
        self._tok = tokenizer
        self.started, self.release = threading.Event(), threading.Event()

    def encode(self, text, **kw):
        self.started.set()
        self.release.wait(10)  # a guard only: the fixed server is released long before
        return self._tok.encode(text, **kw)

    def __getattr__(self, name):
        return getattr(self._tok, name)


@pytest.fixture(scope="module")
def engine(default_model_path):
    from paged.core.engine.engine import Engine
    from paged.core.engine.config import EngineConfig

    return Engine(EngineConfig(model=str(default_model_path), device="cpu", max_model_len=256,
                               kv_cache_memory="32MiB", cpu_threads_bind=str(min(os.sched_getaffinity(0)))))


def test_item2_health_answers_while_a_tokenization_runs(engine):
    from paged.core.entrypoints.async_engine import AsyncEngine
    from paged.core.entrypoints.server.app import ServerConfig, create_app

    prompt = "word " * 1000
    gated = GatedTokenizer(engine.tokenizer)
    aengine = AsyncEngine(engine)
    app = create_app(aengine, gated, ServerConfig("m", engine.max_model_len, engine.model_config.vocab_size))

    async def main():
        aengine.start()
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
                tokenize = asyncio.ensure_future(c.post("/tokenize", json={"prompt": prompt}))
                await asyncio.to_thread(gated.started.wait, 30)
                health = await c.get("/health")
                still_tokenizing = not tokenize.done()
                gated.release.set()
                return health, still_tokenizing, await tokenize
        finally:
            gated.release.set()
            aengine.shutdown()

    health, still_tokenizing, tokenized = asyncio.run(main())
    assert health.status_code == 200 and still_tokenizing
    assert tokenized.json()["tokens"] == engine.tokenizer.encode(prompt)


def test_item2_prompt_that_can_never_fit_is_refused_before_tokenizing(server):
    r = complete(server, {"prompt": "lorem ipsum " * 600_000})  # 7.2 MB
    assert_error(r, 400, "characters", "max_model_len 2048", param="prompt")
    r = httpx.post(server.url + "/tokenize", json={"prompt": "x" * 3_000_000}, timeout=60)
    assert_error(r, 400, "characters", param="prompt")
    r = chat(server, {}, content="y" * 3_000_000)
    assert_error(r, 400, "characters", param="messages")


def test_item2_character_bound_refuses_no_prompt_that_fits(server, engine):
    """max_model_len - 1 copies of the longest token: as many characters as
    a prompt that fits can have. It is tokenized, not refused."""
    tok = engine.tokenizer
    longest = max(range(tok.vocab_size), key=lambda i: len(tok.decode([i], skip_special_tokens=False)))
    text = tok.decode([longest] * 2047, skip_special_tokens=False)
    r = httpx.post(server.url + "/tokenize", json={"prompt": text, "add_special_tokens": False}, timeout=60)
    assert r.status_code == 200, r.text


# -- item 3: 500s for bad input ----------------------------------------------------


BAD_BODIES = {
    "nested-arrays": b'{"prompt": ' + b"[" * 1200 + b"]" * 1200 + b"}",
    "nested-objects": b'{"prompt": "hi", "x": ' + b'{"a": ' * 1200 + b"1" + b"}" * 1200 + b"}",
    "surrogate-prompt": b'{"prompt": "hi \\ud800 there", "max_tokens": 2}',
    "surrogate-stop": b'{"prompt": "hi", "stop": ["\\udfff"], "max_tokens": 2}',
}


@pytest.mark.parametrize("name", BAD_BODIES)
def test_item3_bad_json_is_a_400_on_a_kept_alive_connection(server, name):
    before = server.log_tail(100_000).count("Traceback")
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        for _ in range(2):  # the second request rides the same connection
            conn.request("POST", "/v1/completions", BAD_BODIES[name], {"Content-Type": "application/json"})
            resp = conn.getresponse()
            body = json.loads(resp.read())
            assert resp.status == 400, body
            assert set(body["error"]) == {"message", "type", "param", "code"}
            assert "\n" not in body["error"]["message"]
    finally:
        conn.close()
    assert server.log_tail(100_000).count("Traceback") == before


def test_item3_lone_surrogate_in_a_chat_message(server):
    data = json.dumps({"model": server.model, "messages": [{"role": "user", "content": "a\ud800b"}]}).encode()
    assert_error(raw_post(server, "/v1/chat/completions", data), 400, "surrogate", param="messages")


# -- item 4: OpenAI fields silently ignored ------------------------------------------


@pytest.mark.parametrize("body, field", [
    ({"functions": [{"name": "f", "parameters": {}}]}, "functions"),
    ({"function_call": "auto"}, "function_call"),
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "function_call": {"name": "f"}}]},
     "messages"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"structured_outputs": {"regex": "a+", "structural_tag": {"x": 1}}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a+", "whitespace_pattern": " *"}}, "structured_outputs"),
    ({"audio": {"voice": "x"}}, "audio"),
], ids=["functions", "function_call", "assistant-function_call", "response_format-xml", "structural_tag",
        "whitespace_pattern", "audio"])
def test_item4_unsupported_chat_fields_are_a_400_naming_them(server, body, field):
    """Structured output and tools are served now (issue 20, tests/test_structured_server.py);
    what is still unsupported is refused, never ignored."""
    assert_error(chat(server, dict(body)), 400, "expected", param=field)


def test_item4_best_of_other_than_n_is_a_400(server):
    assert_error(complete(server, {"prompt": "hi", "best_of": 3, "max_tokens": 2}), 400, "best_of", param="best_of")
    assert complete(server, {"prompt": "hi", "best_of": 2, "n": 2, "max_tokens": 2}).status_code == 200


def test_item4_values_that_change_nothing_are_accepted(server):
    r = chat(server, {"response_format": {"type": "text"}, "tool_choice": "none", "parallel_tool_calls": False,
                      "store": False, "user": "u-1", "metadata": {"k": "v"}, "tools": [],
                      "some_vendor_field": {"x": 1}})
    assert r.status_code == 200, r.text


def test_item4_logit_bias_bans_and_forces_tokens(server):
    base = {"prompt": "The capital of France is", "max_tokens": 1, "temperature": 0}
    first = complete(server, base).json()["choices"][0]["text"]
    ids = httpx.post(server.url + "/tokenize", json={"prompt": first, "add_special_tokens": False}).json()["tokens"]
    banned = complete(server, {**base, "logit_bias": {str(t): -100 for t in ids}}).json()["choices"][0]["text"]
    assert banned != first
    forced_id = httpx.post(server.url + "/tokenize", json={"prompt": " banana", "add_special_tokens": False}
                           ).json()["tokens"][0]
    forced = complete(server, {**base, "max_tokens": 3, "logit_bias": {str(forced_id): 100}})
    want = httpx.post(server.url + "/detokenize", json={"tokens": [forced_id] * 3}).json()["prompt"]
    assert forced.json()["choices"][0]["text"] == want
    assert_error(complete(server, {**base, "logit_bias": {"12": 101}}), 400, "logit_bias", param="logit_bias")
    assert_error(complete(server, {**base, "logit_bias": {"10000000": 1}}), 400, "logit_bias", param="logit_bias")


# -- item 8: smaller -------------------------------------------------------------------


def test_item8_empty_prompt_is_a_400_before_the_stream_starts(server):
    assert_error(complete(server, {"prompt": "", "stream": True}), 400, "prompt", param="prompt")


def test_item8_more_prompts_than_the_queue_holds_is_a_400_not_a_retry(keyed):
    r = complete(keyed, {"prompt": ["a", "b", "c"], "max_tokens": 1}, headers=AUTH)
    assert_error(r, 400, "at most 2 prompts", param="prompt")


@pytest.mark.parametrize("field,value", [("max_tokens", "10"), ("stream", "yes"), ("prompt", [True, False]),
                                         ("n", 1.5), ("echo", 1), ("logprobs", True)])
def test_item8_no_type_coercion(server, field, value):
    assert_error(complete(server, {"prompt": "hi", "max_tokens": 2, field: value}), 400, field, param=field)


def test_item8_non_finite_numbers_are_refused(server):
    for literal in (b"Infinity", b"-Infinity", b"NaN"):
        data = b'{"prompt": "hi", "max_tokens": 2, "repetition_penalty": ' + literal + b"}"
        assert_error(raw_post(server, "/v1/completions", data), 400, "JSON")
    data = b'{"prompt": "hi", "max_tokens": 2, "repetition_penalty": 1e400}'  # parses to inf
    assert_error(raw_post(server, "/v1/completions", data), 400, "finite", param="repetition_penalty")


def test_item8_models_shows_no_path(server):
    model = httpx.get(server.url + "/v1/models").json()["data"][0]
    assert model["root"] == model["id"] == server.model and "/" not in json.dumps(model)


def test_item8_no_redirect_to_the_host_header(server):
    r = httpx.get(server.url + "/v1/models/", headers={"Host": "evil.example"}, follow_redirects=False)
    assert "location" not in r.headers and r.status_code == 404
    assert r.json()["error"]["type"] == "not_found_error"


# -- item 9: the API publishes its schema -------------------------------------------------


def test_item9_openapi_declares_the_request_bodies(server):
    schema = httpx.get(server.url + "/openapi.json").json()
    comps = schema["components"]["schemas"]
    for path, field in (("/v1/completions", "prompt"), ("/v1/chat/completions", "messages"),
                        ("/tokenize", "prompt"), ("/detokenize", "tokens")):
        ref = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        body = comps[ref.rsplit("/", 1)[1]]
        assert field in body["properties"], (path, body)
        assert "400" in schema["paths"][path]["post"]["responses"]
        assert "422" not in schema["paths"][path]["post"]["responses"]
    assert comps["CompletionRequest"]["properties"]["model"]["anyOf"][0]["enum"] == [server.model]
    assert "<html" in httpx.get(server.url + "/docs").text.lower()


def test_item9_schema_endpoints_sit_behind_the_api_key(keyed):
    for path in ("/openapi.json", "/docs"):
        assert_error(httpx.get(keyed.url + path), 401, "API key")
        assert httpx.get(keyed.url + path, headers=AUTH).status_code == 200
    schema = httpx.get(keyed.url + "/openapi.json", headers=AUTH).json()
    assert schema["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    assert schema["paths"]["/v1/completions"]["post"]["security"] == [{"bearer": []}]
    assert "security" not in schema["paths"]["/health"]["get"]


# -- issue 46: /openapi.json and the server agree; a body cut off mid-read -----------------


def served_validator(server, component: str):
    """A JSON Schema validator for one request body as /openapi.json publishes it."""
    import jsonschema

    schema = httpx.get(server.url + "/openapi.json").json()
    return jsonschema.Draft202012Validator({"$ref": f"#/components/schemas/{component}",
                                            "components": schema["components"]})


def test_issue46_whole_number_floats_are_integers(server):
    """JSON Schema's integer includes 2.0; the served schema says integer."""
    validator = served_validator(server, "CompletionRequest")
    as_ints = {"prompt": "The sea is", "max_tokens": 3, "min_tokens": 0, "n": 1, "temperature": 0}
    as_floats = {**as_ints, "max_tokens": 3.0, "min_tokens": 0.0, "n": 1.0}
    assert validator.is_valid({**as_floats, "model": server.model})
    floats = complete(server, as_floats)
    assert floats.status_code == 200, floats.text
    assert floats.json()["choices"][0]["text"] == complete(server, as_ints).json()["choices"][0]["text"]
    r = httpx.post(server.url + "/detokenize", json={"tokens": [1.0, 2]})
    assert r.json() == httpx.post(server.url + "/detokenize", json={"tokens": [1, 2]}).json()
    assert not validator.is_valid({"prompt": "x", "n": 1.5})
    assert_error(complete(server, {"prompt": "x", "n": 1.5}), 400, "integer", param="n")


def test_issue46_what_the_schema_refuses_the_server_refuses(server):
    """Each body the server refuses here, the served schema calls invalid
    (and the body beside it that both accept)."""
    cases = [("CompletionRequest", "/v1/completions", {"prompt": ""}, {"prompt": "a", "max_tokens": 1}),
             ("CompletionRequest", "/v1/completions", {"prompt": ["a", ""]}, {"prompt": ["a"], "max_tokens": 1}),
             ("CompletionRequest", "/v1/completions", {"prompt": "a", "best_of": 3}, {"prompt": "a", "best_of": None,
                                                                                        "max_tokens": 1}),
             ("TokenizeRequest", "/tokenize", {}, {"prompt": ""}),
             ("TokenizeRequest", "/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]},
              {"prompt": "a", "messages": None})]
    for component, path, refused, accepted in cases:
        validator = served_validator(server, component)
        assert not validator.is_valid(refused), refused
        assert httpx.post(server.url + path, json=refused, timeout=60).status_code == 400, refused
        assert validator.is_valid(accepted), accepted
        r = httpx.post(server.url + path, json=accepted, timeout=60)
        assert r.status_code == 200, (accepted, r.text)


def test_issue46_405_names_the_allowed_methods(server):
    for method, path, allowed in (("GET", "/v1/completions", "POST"), ("DELETE", "/v1/chat/completions", "POST"),
                                  ("POST", "/health", "GET"), ("PUT", "/v1/engine/state", "GET")):
        r = httpx.request(method, server.url + path)
        assert_error(r, 405, "Method Not Allowed")
        methods = {m.strip() for m in r.headers["allow"].split(",")}
        assert allowed in methods and method not in methods, r.headers["allow"]


def test_issue46_a_client_gone_mid_body_leaves_one_quiet_line_and_nothing_held(server):
    import socket
    import time

    log_start = os.path.getsize(server.log.name)
    for _ in range(3):
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 100000\r\n\r\n" + b'{"prompt": "' + b"a" * 1000)
    time.sleep(1.0)  # the server notices on its next read
    assert httpx.get(server.url + "/health").status_code == 200
    assert complete(server, {"prompt": "hi", "max_tokens": 1}).status_code == 200
    server.log.flush()
    with open(server.log.name) as f:
        added = f.read()[log_start:]
    assert "Traceback" not in added and "ClientDisconnect" not in added, added[-3000:]
    state = httpx.get(server.url + "/v1/engine/state").json()
    assert state["requests"]["in_flight"] == 0 and state["kv_cache"]["blocks_used"] == 0
