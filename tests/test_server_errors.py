"""Error paths of `paged serve`: every status the API promises, in OpenAI's
error JSON, and a clean exit on SIGTERM. One server with --api-key and a
tiny waiting queue; one more for the shutdown test."""

from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import pytest

from test_server import ServerProcess, shared_server

KEY = "test-key-123"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server():
    return shared_server("--api-key", KEY, "--max-waiting-requests", "2", "--max-num-seqs", "1",
                         "--max-body-size", "65536")


def post(server, path, body, headers=AUTH, **kw):
    return httpx.post(server.url + path, json=body, headers=headers, timeout=60, **kw)


def assert_error(r: httpx.Response, status: int, *words: str, param=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    for w in words:
        assert w in err["message"], (w, err["message"])
    if param is not None:
        assert err["param"] == param, err


def test_401_without_or_with_wrong_key(server):
    body = {"model": server.model, "prompt": "hi", "max_tokens": 1}
    assert_error(post(server, "/v1/completions", body, headers={}), 401, "API key")
    assert_error(post(server, "/v1/completions", body, headers={"Authorization": "Bearer nope"}), 401)
    assert httpx.get(server.url + "/v1/models").status_code == 401
    assert post(server, "/v1/completions", body).status_code == 200
    assert httpx.get(server.url + "/health").status_code == 200  # probes need no key


def test_404_unknown_model_and_route(server):
    assert_error(post(server, "/v1/completions", {"model": "gpt-17", "prompt": "hi"}), 404, "gpt-17",
                 param="model")
    assert_error(post(server, "/v1/chat/completions", {"model": "gpt-17", "messages": [
        {"role": "user", "content": "hi"}]}), 404, "gpt-17")
    assert httpx.get(server.url + "/v1/nothing", headers=AUTH).status_code == 404


def test_413_oversized_body(server):
    big = {"model": server.model, "prompt": "x" * 100_000}
    assert_error(post(server, "/v1/completions", big), 413, "65536")

    def chunks():  # no Content-Length: the limit is enforced while reading
        for _ in range(20):
            yield b" " * 8192

    r = httpx.post(server.url + "/v1/completions", content=chunks(), headers=AUTH, timeout=60)
    assert_error(r, 413, "limit")


BAD_FIELDS = [
    ("temperature", -0.5), ("temperature", "hot"), ("top_p", 0), ("top_p", 1.5), ("n", 0), ("max_tokens", 0),
    ("max_tokens", -3), ("top_k", -7), ("min_p", 2.0), ("presence_penalty", 3), ("frequency_penalty", -9),
    ("repetition_penalty", 0), ("logprobs", 99), ("stop", [""]), ("stop", 5), ("stop_token_ids", [-1]),
    ("stop_token_ids", [10**9]), ("seed", "abc"), ("min_tokens", -1), ("ignore_eos", "maybe"),
    ("prompt", []), ("prompt", [10**9]), ("prompt", None), ("stream_options", 3),
]


@pytest.mark.parametrize("field,value", BAD_FIELDS, ids=[f"{f}={v!r}"[:40] for f, v in BAD_FIELDS])
def test_400_bad_completion_field(server, field, value):
    body = {"model": server.model, "prompt": "hi", "max_tokens": 4, field: value}
    r = post(server, "/v1/completions", body)
    assert_error(r, 400, field, param=field)


def test_400_min_tokens_over_max_tokens(server):
    r = post(server, "/v1/completions", {"model": server.model, "prompt": "hi", "max_tokens": 2, "min_tokens": 5})
    assert_error(r, 400, "min_tokens", param="min_tokens")


@pytest.mark.parametrize("body", [
    {"messages": []}, {"messages": [{"role": "wizard", "content": "x"}]}, {"messages": "hello"},
    {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0},
    {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3},
    {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
], ids=["empty", "role", "not-list", "max0", "top-logprobs-alone", "image"])
def test_400_bad_chat_fields(server, body):
    assert_error(post(server, "/v1/chat/completions", {"model": server.model, **body}), 400)


def test_400_malformed_json_and_non_object(server):
    r = httpx.post(server.url + "/v1/completions", content=b"{not json", headers=AUTH)
    assert_error(r, 400, "JSON")
    assert_error(post(server, "/v1/completions", [1, 2]), 400, "object")


def test_400_prompt_plus_max_tokens_beyond_context(server):
    ids = [1000] * 2000
    r = post(server, "/v1/completions", {"model": server.model, "prompt": ids, "max_tokens": 100})
    assert_error(r, 400, "2048", "2000", "100", param="max_tokens")
    r = post(server, "/v1/completions", {"model": server.model, "prompt": [1000] * 2048, "max_tokens": 1})
    assert_error(r, 400, "2048", param="prompt")
    r = post(server, "/v1/chat/completions", {"model": server.model, "max_completion_tokens": 4000,
                                             "messages": [{"role": "user", "content": "hi"}]})
    assert_error(r, 400, "2048", param="max_completion_tokens")
    # streaming requests are refused before the stream starts
    r = post(server, "/v1/completions", {"model": server.model, "prompt": ids, "max_tokens": 100, "stream": True})
    assert_error(r, 400, "2048")


def test_503_when_waiting_queue_is_full(server):
    body = {"model": server.model, "prompt": "Tell me a story", "max_tokens": 64, "ignore_eos": True}

    async def main():
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=120,
                                     limits=httpx.Limits(max_connections=32)) as c:
            return await asyncio.gather(*(c.post("/v1/completions", json=body) for _ in range(10)))

    statuses = [r.status_code for r in asyncio.run(main())]
    assert set(statuses) <= {200, 503} and statuses.count(503) >= 1 and statuses.count(200) >= 2, statuses
    r = next(r for r in asyncio.run(main()) if r.status_code == 503)
    assert_error(r, 503, "waiting queue is full")
    assert post(server, "/v1/completions", {**body, "max_tokens": 2}).status_code == 200  # serving goes on


def test_idle_sigterm_exits_0_and_frees_the_engine():
    """Nothing in flight: the server exits at once, with the grace timer
    cancelled and the engine's native objects freed before interpreter
    teardown (else nanobind reports them as leaked on stderr)."""
    srv = ServerProcess()
    try:
        assert post(srv, "/v1/completions", {"model": srv.model, "prompt": "Hi", "max_tokens": 2}).status_code == 200
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(15) == 0, srv.log_tail()
        assert "leaked" not in srv.log_tail(), srv.log_tail()
    finally:
        srv.stop()


def test_sigterm_finishes_in_flight_and_exits_0():
    srv = ServerProcess("--shutdown-timeout", "4")
    try:
        body = {"model": srv.model, "prompt": "Count slowly:", "max_tokens": 1500, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: "))  # generating now
            start = time.monotonic()
            srv.proc.send_signal(signal.SIGTERM)
            rc = srv.proc.wait(4 + 15)
            elapsed = time.monotonic() - start
            rest = [line for line in lines if line.startswith("data: ")]
        assert rc == 0, srv.log_tail()
        assert elapsed < 4 + 10, elapsed
        # the stream ended (finished or aborted within the grace period), never a hang
        assert not rest or rest[-1] == "data: [DONE]" or json.loads(rest[-1][6:])
    finally:
        srv.stop()
