"""End-to-end tests of `paged serve`: a real server process on 127.0.0.1
with the default model, driven by the official openai client and httpx.

Oracles: the same request run alone (batching must not change greedy
output), the server's own /tokenize for token counts, the KV cache gauge
returning to zero blocks used after aborts, prometheus_client's parser.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import pytest
from conftest import ENGINE_LEVELS, skip_unless_level

STARTUP_TIMEOUT_S = 300
# small KV cache: 2048-token context, enough blocks for the concurrency tests
# Settings the assertions depend on are pinned, never left to `auto`.
BASE_ARGS = ("--max-model-len", "2048", "--kv-cache-memory", "256MiB", "--max-num-seqs", "32",
             "--dtype", "float32", "--block-size", "128")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`paged --device cpu serve ...` in a subprocess on a free loopback port."""

    def __init__(self, *extra: str, env: dict[str, str] | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="paged-serve-", suffix=".log", delete=False)
        model = os.environ.get("PAGED_TEST_MODEL")
        cmd = [sys.executable, "-c", "import sys; from paged.core.entrypoints.cli import main; sys.exit(main())",
               "--device", "cpu", "serve", "--port", str(self.port), *BASE_ARGS, *extra]
        if model:
            cmd += ["--model", model]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})})
        try:
            self._wait_ready(extra)
        except BaseException:  # never leak a server process
            self.stop()
            raise

    def _wait_ready(self, extra) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"server exited with {self.proc.returncode} during startup:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            self.stop()
            pytest.fail(f"server not healthy after {STARTUP_TIMEOUT_S} s:\n{self.log_tail()}")
        key = extra[extra.index("--api-key") + 1] if "--api-key" in extra else None
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.model = httpx.get(self.url + "/v1/models", headers=self.headers).json()["data"][0]["id"]

    def log_tail(self, n: int = 4000) -> str:
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()[-n:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


_SHARED: dict[tuple, ServerProcess] = {}


def shared_server(*extra: str, level: str | None = None) -> ServerProcess:
    """One server per argument set (and ISA level: None = all this CPU has)
    for the whole pytest run (modules share it)."""
    from paged.backends.cpu.host import isa as cpu_isa

    key = (extra, level)
    if key not in _SHARED:
        env = cpu_isa.hide_env(level) if level else None
        _SHARED[key] = server = ServerProcess(*extra, env=env)
        atexit.register(server.stop)
    return _SHARED[key]


def metrics(url: str) -> dict[str, float]:
    """/metrics parsed by prometheus_client: sample name -> value (first label set)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics").text
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if "le" not in sample.labels:
                out.setdefault(sample.name, sample.value)
    return out


def wait_idle(url: str, timeout: float = 30.0) -> dict[str, float]:
    """Metrics once no request runs and no KV block is held (or the last seen)."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(url)
        idle = m["paged:kv_cache_blocks_used"] == 0 and m["paged:num_requests_running"] == 0 \
            and m["paged:num_requests_waiting"] == 0
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.2)


@pytest.fixture(scope="module", params=ENGINE_LEVELS)
def server(request):
    """The server at each ISA level this CPU runs (conftest.ENGINE_LEVELS)."""
    from paged.backends.cpu.host import isa as cpu_isa

    skip_unless_level(request.param)
    best = request.param == cpu_isa.supported_levels()[0]  # that one is shared with other modules
    return shared_server() if best else shared_server(level=request.param)


@pytest.fixture(scope="module")
def client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused")


# -- the openai client -------------------------------------------------------


def test_models_health_version(server):
    models = httpx.get(server.url + "/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["max_model_len"] == 2048
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/version").json()["version"]


def test_completion_matches_tokenize_counts(server, client):
    prompt = "The capital of France is"
    r = client.completions.create(model=server.model, prompt=prompt, max_tokens=8, temperature=0)
    n_prompt = httpx.post(server.url + "/tokenize", json={"prompt": prompt}).json()["count"]
    assert r.usage.prompt_tokens == n_prompt
    assert 1 <= r.usage.completion_tokens <= 8
    choice = r.choices[0]
    assert choice.finish_reason in ("stop", "length")
    # the text is the detokenized completion: it re-tokenizes to no more tokens than were generated
    assert len(httpx.post(server.url + "/tokenize", json={"prompt": choice.text, "add_special_tokens": False})
               .json()["tokens"]) <= r.usage.completion_tokens + 1


def test_completion_stream_equals_non_stream(server, client):
    kw = dict(model=server.model, prompt="Once upon a time", max_tokens=12, temperature=0)
    whole = client.completions.create(**kw).choices[0].text
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1


def test_completion_prompt_forms_and_n(server, client):
    ids = httpx.post(server.url + "/tokenize", json={"prompt": "Hello there"}).json()["tokens"]
    by_text = client.completions.create(model=server.model, prompt="Hello there", max_tokens=6, temperature=0)
    by_ids = client.completions.create(model=server.model, prompt=ids, max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    many = client.completions.create(model=server.model, prompt=[ids, ids], max_tokens=6, temperature=0, n=2)
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    assert all(c.text == by_text.choices[0].text for c in many.choices)
    echoed = client.completions.create(model=server.model, prompt="Hello there", max_tokens=6, temperature=0,
                                       echo=True)
    assert echoed.choices[0].text == "Hello there" + by_text.choices[0].text


def test_completion_logprobs_and_stop(server, client):
    r = client.completions.create(model=server.model, prompt="1, 2, 3, 4,", max_tokens=8, temperature=0,
                                  logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == r.usage.completion_tokens == len(lp.token_logprobs)
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert chosen <= 0.0 and max(top.values()) >= chosen - 1e-4  # greedy picks the most likely
    text = r.choices[0].text
    stop = text.strip()[:2] if text.strip() else None
    if stop:
        cut = client.completions.create(model=server.model, prompt="1, 2, 3, 4,", max_tokens=8, temperature=0,
                                        stop=[stop])
        assert stop not in cut.choices[0].text and cut.choices[0].finish_reason == "stop"


def test_chat_stream_and_non_stream(server, client):
    messages = [{"role": "user", "content": "Say hello in one word."}]
    whole = client.chat.completions.create(model=server.model, messages=messages, max_completion_tokens=10,
                                           temperature=0)
    n_prompt = httpx.post(server.url + "/tokenize", json={"messages": messages}).json()["count"]
    assert whole.usage.prompt_tokens == n_prompt
    assert whole.choices[0].message.role == "assistant"
    stream = list(client.chat.completions.create(model=server.model, messages=messages, max_completion_tokens=10,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert stream[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == whole.choices[0].message.content
    assert stream[-1].usage.completion_tokens == whole.usage.completion_tokens
    lp = client.chat.completions.create(model=server.model, messages=messages, max_completion_tokens=4,
                                        temperature=0, logprobs=True, top_logprobs=2)
    content = lp.choices[0].logprobs.content
    assert len(content) == lp.usage.completion_tokens and all(len(t.top_logprobs) == 2 for t in content)


def test_tokenize_detokenize_roundtrip(server):
    ids = httpx.post(server.url + "/tokenize", json={"prompt": "paged attention", "add_special_tokens": False}
                     ).json()["tokens"]
    assert httpx.post(server.url + "/detokenize", json={"tokens": ids}).json()["prompt"] == "paged attention"


# -- concurrency ---------------------------------------------------------------


async def _stream_text(client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int) -> str:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    parts = []
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                msg = json.loads(line[6:])
                assert "error" not in msg, msg
                parts += [c["text"] for c in msg["choices"]]
    return "".join(parts)


PROMPTS = ["The sky is", "My favourite food is", "In 1492,", "def fibonacci(n):", "Dear diary, today",
           "The quick brown fox", "Water boils at", "Paris is a city"]


def test_32_concurrent_streams_equal_alone(server):
    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
            alone = {p: await _stream_text(c, server.model, p, 16) for p in PROMPTS}
            prompts = [PROMPTS[i % len(PROMPTS)] for i in range(32)]
            together = await asyncio.gather(*(_stream_text(c, server.model, p, 16) for p in prompts))
        return alone, prompts, together

    alone, prompts, together = asyncio.run(main())
    assert [alone[p] for p in prompts] == list(together)
    m = wait_idle(server.url)
    assert m["paged:kv_cache_blocks_used"] == 0


async def open_and_drop(c: httpx.AsyncClient, model: str, prompt: str, max_tokens: int) -> None:
    """A streamed completion the client leaves after two events."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    async with c.stream("POST", "/v1/completions", json=body) as r:
        n = 0
        async for line in r.aiter_lines():
            n += line.startswith("data: ")
            if n >= 2:
                break  # leaving the block closes the connection mid-stream


def test_disconnect_storm_frees_all_blocks(server):

    async def non_streaming_drop(c: httpx.AsyncClient):
        body = {"model": server.model, "prompt": "Tell me a long story.", "max_tokens": 1500, "ignore_eos": True}
        with pytest.raises(httpx.TimeoutException):
            await c.post("/v1/completions", json=body, timeout=1.0)

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=120,
                                     limits=httpx.Limits(max_connections=64)) as c:
            await asyncio.gather(*(open_and_drop(c, server.model, PROMPTS[i % len(PROMPTS)] * 8, 1500)
                                   for i in range(24)), non_streaming_drop(c))

    asyncio.run(main())
    m = wait_idle(server.url)
    assert m["paged:kv_cache_blocks_used"] == 0 and m["paged:num_requests_running"] == 0
    assert m["paged:kv_cache_blocks_total"] > 0
    assert m["paged:kv_cache_usage_perc"] == 0.0


def test_metrics_parse_and_count(server, client):
    before = metrics(server.url)
    r = client.completions.create(model=server.model, prompt="Count me", max_tokens=5, temperature=0)
    after = metrics(server.url)
    assert after["paged:prompt_tokens_total"] - before["paged:prompt_tokens_total"] == r.usage.prompt_tokens
    assert after["paged:generation_tokens_total"] - before["paged:generation_tokens_total"] \
        == r.usage.completion_tokens
    assert after["paged:e2e_request_latency_seconds_count"] == before["paged:e2e_request_latency_seconds_count"] + 1
    assert after["paged:time_to_first_token_seconds_count"] > before["paged:time_to_first_token_seconds_count"]
    for name in ("paged:num_preemptions_total", "paged:prefix_cache_hit_rate", "paged:kv_cache_usage_perc"):
        assert name in after
