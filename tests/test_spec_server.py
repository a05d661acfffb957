"""`paged serve --speculative-config ...` end to end: a streamed completion
whose chunks carry several tokens each gives the non-streamed text (with a
stop string cutting it), per-token logprobs arrive for every token, and
/metrics reports the acceptance rate and tokens per step. Oracle: the same
server's non-streamed answer, and tests/test_spec_decode.py's engine-level
equality with plain decoding."""

from __future__ import annotations

import json

import httpx
from test_server import ServerProcess, metrics

SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}'
PROMPT = "Copy: the cat sat on the mat. the dog ran to the park. the cat sat on the mat. the dog"


def test_streamed_chunks_carry_several_tokens_and_metrics_count_them():
    server = ServerProcess("--speculative-config", SPEC, "--cpu-threads-bind", "none")
    try:
        body = {"model": server.model, "prompt": PROMPT, "max_tokens": 40, "temperature": 0, "ignore_eos": True,
                "logprobs": 1}
        whole = httpx.post(server.url + "/v1/completions", json=body, timeout=120).json()["choices"][0]
        chunks, tokens = [], 0
        with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    choice = json.loads(line[6:])["choices"][0]
                    chunks.append(choice["text"])
                    n = len((choice.get("logprobs") or {}).get("tokens") or [])
                    tokens = max(tokens, n)
        assert "".join(chunks) == whole["text"]
        assert tokens > 1, "some chunk must carry an accepted run of several tokens"
        assert len(whole["logprobs"]["tokens"]) == 40
        stop = whole["text"][len(whole["text"]) // 2:][:5]
        cut = httpx.post(server.url + "/v1/completions", json={**body, "stop": [stop]}, timeout=120).json()
        assert cut["choices"][0]["text"] == whole["text"][:whole["text"].index(stop)]
        m = metrics(server.url)
        assert m["paged:spec_decode_num_accepted_tokens_total"] > 0
        assert 0 < m["paged:spec_decode_acceptance_rate"] <= 1
        assert m["paged:spec_decode_tokens_per_step"] > 1
    finally:
        server.stop()
