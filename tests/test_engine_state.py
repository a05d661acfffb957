"""GET /v1/engine/state and the web page's files, without a browser (the
browser test is tests/test_web_page.py).

The app runs in-process on a real Engine with the default model, so the
oracle is the engine itself: its KV cache manager's and scheduler's own
counts, and the usage the API answered for each request. The history's
binning is checked on a fake clock against sums computed here.
"""

from __future__ import annotations

import asyncio
import os

import httpx
import pytest

from paged.core.entrypoints.server.live import LiveHistory

KEY = "state-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def engine(default_model_path):
    from paged.core.engine.config import EngineConfig
    from paged.core.engine.engine import Engine

    return Engine(EngineConfig(model=str(default_model_path), device="cpu", dtype="float32", max_model_len=256,
                               kv_cache_memory="32MiB", block_size=16,
                               cpu_threads_bind=str(min(os.sched_getaffinity(0)))))


def run_app(engine, calls, api_key=KEY):
    """`calls(client)` against the app on `engine`, the engine thread running."""
    from paged.core.entrypoints.async_engine import AsyncEngine
    from paged.core.entrypoints.server.app import ServerConfig, create_app

    aengine = AsyncEngine(engine)
    app = create_app(aengine, engine.tokenizer, ServerConfig("m", engine.max_model_len,
                                                             engine.model_config.vocab_size, api_key=api_key))

    async def main():
        aengine.start()
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t",
                                         timeout=120) as client:
                return await calls(client)
        finally:
            aengine.shutdown()

    return asyncio.run(main())


async def idle_state(client) -> dict:
    """The state once nothing runs (the snapshot is taken after each step)."""
    for _ in range(200):
        state = (await client.get("/v1/engine/state", headers=AUTH)).json()
        if state["requests"]["running"] == state["requests"]["waiting"] == state["kv_cache"]["blocks_used"] == 0:
            return state
        await asyncio.sleep(0.05)
    return state


def test_state_counts_what_the_engine_and_the_api_counted(engine):
    prompt = "The history of the printing press begins in " * 4  # spans whole blocks: a prefix to reuse

    async def calls(client):
        before = await idle_state(client)
        answers = []
        for _ in range(2):  # the second finds the first one's prompt blocks in the prefix cache
            r = await client.post("/v1/completions", headers=AUTH, json={
                "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True})
            answers.append(r.json())
        r = await client.post("/v1/chat/completions", headers=AUTH, json={
            "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0, "ignore_eos": True})
        answers.append(r.json())
        return before, answers, await idle_state(client)

    before, answers, state = run_app(engine, calls)
    kv = engine.kv_cache_manager.stats()
    assert state["kv_cache"] == {"blocks_total": kv["num_blocks"], "blocks_used": kv["used"],
                                 "blocks_free": kv["free"], "blocks_cached": kv["cached"], "usage": kv["usage"],
                                 "prefix_queries": kv["prefix_queries"], "prefix_hits": kv["prefix_hits"],
                                 "prefix_hit_rate": kv["hit_rate"]}
    assert kv["prefix_hits"] > before["kv_cache"]["prefix_hits"]  # the repeated prompt was a hit
    assert state["requests"]["preemptions"] == engine.scheduler.num_preemptions

    generated = sum(a["usage"]["completion_tokens"] for a in answers)
    assert state["requests"]["finished"] == len(answers)
    assert state["requests"]["generation_tokens"] == generated == 6 + 6 + 3
    assert sum(state["history"]["output_tokens_per_s"]) == generated
    assert len(state["history"]["output_tokens_per_s"]) == state["history"]["window_s"]

    recent = state["recent"]  # newest first
    assert [r["id"].split("-")[0] for r in recent] == ["chatcmpl", "cmpl", "cmpl"]
    for record, answer in zip(recent, reversed(answers)):
        assert record["prompt_tokens"] == answer["usage"]["prompt_tokens"]
        assert record["output_tokens"] == answer["usage"]["completion_tokens"]
        assert record["finish_reason"] == answer["choices"][0]["finish_reason"] == "length"
        assert 0 < record["ttft_s"] <= record["e2e_s"]
        n = record["output_tokens"]
        assert record["itl_s"] == pytest.approx((record["e2e_s"] - record["ttft_s"]) / (n - 1))
    assert len(state["history"]["ttft_s"]) == len(answers) and len(state["history"]["itl_s"]) == len(answers)
    assert sorted(v for _, v in state["history"]["ttft_s"]) == sorted(r["ttft_s"] for r in recent)


def test_state_needs_the_key_and_the_page_does_not(engine):
    async def calls(client):
        return {"state_without": await client.get("/v1/engine/state"),
                "state_wrong": await client.get("/v1/engine/state", headers={"Authorization": "Bearer nope"}),
                "state": await client.get("/v1/engine/state", headers=AUTH),
                "page": await client.get("/"),
                "js": await client.get("/static/app.js"),
                "css": await client.get("/static/style.css"),
                "missing": await client.get("/static/nothing.js"),
                "schema": await client.get("/openapi.json", headers=AUTH)}

    r = run_app(engine, calls)
    for name in ("state_without", "state_wrong"):
        assert r[name].status_code == 401 and r[name].json()["error"]["code"] == "invalid_api_key"
    assert r["state"].status_code == 200
    page = r["page"]
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in page.headers["content-security-policy"]
    assert KEY not in page.text and "http://" not in page.text and "https://" not in page.text  # nothing fetched
    assert r["js"].headers["content-type"].startswith("text/javascript")
    assert r["css"].headers["content-type"].startswith("text/css")
    assert r["missing"].status_code == 404 and "error" in r["missing"].json()
    op = r["schema"].json()["paths"]["/v1/engine/state"]["get"]
    assert op["security"] == [{"bearer": []}]
    assert op["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].endswith("/EngineState")


def test_history_bins_and_window_on_a_fake_clock():
    now = [1000.2]
    history = LiveHistory(window_s=60, clock=lambda: now[0])
    events = [(1000.2, 3), (1000.7, 2), (1001.1, 4), (1059.9, 5), (1062.5, 7)]
    for t, n in events:
        now[0] = t
        history.on_tokens(n)
    history.on_first_token(0.25)
    history.on_finish("r1", prompt_tokens=4, output_tokens=5, e2e=1.25, ttft=0.25, finish_reason="stop")
    now[0] = 1063.0
    h = history.state({}, 0, "m", 1, {})["history"]
    start = 1063 - 60 + 1
    assert h["start"] == start and len(h["output_tokens_per_s"]) == 60
    expected = [0] * 60
    for t, n in events:
        if int(t) >= start:
            expected[int(t) - start] += n
    assert h["output_tokens_per_s"] == expected  # 1000 and 1001 fell out of the window
    assert h["ttft_s"] == [[1062.5, 0.25]] and h["itl_s"] == [[1062.5, 0.25]]
    now[0] = 1062.5 + 61
    later = history.state({}, 0, "m", 1, {})
    assert later["history"]["ttft_s"] == later["history"]["itl_s"] == []
    assert later["recent"][0]["id"] == "r1"  # the list of recent requests is not windowed
