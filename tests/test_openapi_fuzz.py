"""Schemathesis against the served /openapi.json (issue 22): whatever a
client sends, valid by the schema or not, the answer is never a 5xx and
every error is OpenAI-shaped, {"error": {"message": str, "type": str, ...}}.

Bounded to run in well under a minute on two shared cores: hypothesis is
derandomized (the same examples every run, no example database), each
operation and mode gets a capped number of examples, and requests that
would generate many tokens are cut to 2 tokens and 2 samples.
"""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings

from test_server import shared_server
from test_server_errors import AUTH
from test_server_hardening import ERRORS_SERVER_ARGS

MAX_EXAMPLES = 20
GENERATION_FIELDS = ("max_tokens", "max_completion_tokens", "min_tokens", "n", "best_of")


@pytest.fixture(scope="module")
def keyed():
    return shared_server(*ERRORS_SERVER_ARGS)


@pytest.fixture(scope="module")
def schema(keyed):
    served = httpx.get(keyed.url + "/openapi.json", headers=AUTH, timeout=30)
    assert served.status_code == 200, served.text
    return schemathesis.openapi.from_dict(served.json())


POSITIVE, NEGATIVE = schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE
POSTS = ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]
GETS = ["/v1/models", "/health", "/version", "/metrics", "/v1/engine/state"]  # no inputs: nothing negative to generate
CASES = [("POST", p, m) for p in POSTS for m in (POSITIVE, NEGATIVE)] + [("GET", p, POSITIVE) for p in GETS]


def cut_generation(case) -> None:
    """At most 2 tokens x 2 samples per generated request (validity kept)."""
    body = case.body
    if not isinstance(body, dict):
        return
    for key in GENERATION_FIELDS:
        value = body.get(key)
        # 3.0 is an integer too (JSON Schema's, and the server's)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 2:
            body[key] = 2
    # absent or null lengths mean "what the context leaves": ~2000 tokens behind --max-num-seqs 1
    if case.path in ("/v1/completions", "/v1/chat/completions") and \
            all(body.get(k) is None for k in ("max_tokens", "max_completion_tokens")):
        body["max_tokens" if case.path == "/v1/completions" else "max_completion_tokens"] = 2


def assert_openai_answer(response) -> None:
    assert response.status_code < 500, (response.status_code, response.text[:500])
    if response.status_code >= 400:
        error = response.json()["error"]
        assert isinstance(error["message"], str) and isinstance(error["type"], str), error
        assert "\n" not in error["message"], error["message"]


@pytest.mark.parametrize("method,path,mode", CASES, ids=[f"{m} {p} {g.value}" for m, p, g in CASES])
def test_no_5xx_and_openai_errors(keyed, schema, method, path, mode):
    @settings(max_examples=MAX_EXAMPLES, derandomize=True, database=None, deadline=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(schema[path][method].as_strategy(mode))
    def run(case):
        cut_generation(case)
        assert_openai_answer(case.call(base_url=keyed.url, headers=AUTH, timeout=60))

    run()
