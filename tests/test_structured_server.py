"""Structured output and tool calls through the OpenAI API (issue 20): a
real `paged serve` (test_server's shared server), the official openai client.

Oracles: the client's own parsing (`parse`, `pydantic_function_tool`), the
jsonschema package, and for streams the non-streamed answer to the same
greedy request (deltas must add up to it).
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from test_server import shared_server
from test_server_errors import assert_error

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                   "required": ["city"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris, and what time is it there?"}]


def PATTERNS(n: int) -> dict:
    """n string properties with distinct patterns: llguidance's costliest
    schema per byte (~1 s at 128 KiB, 6.6 s and a panic at 680 KB)."""
    return {"type": "object", "properties": {
        f"p{i}": {"type": "string", "pattern": f"^[a-z]{{{i % 7 + 1},{i % 13 + 9}}}x{i}$"} for i in range(n)}}


class Person(BaseModel):
    name: str = Field(max_length=20)
    age: int = Field(ge=0, le=120)


class GetWeather(BaseModel):
    """The current weather in a city."""

    city: str = Field(max_length=30)
    unit: str = Field(pattern="^(celsius|fahrenheit)$")


@pytest.fixture(scope="module")
def server():
    return shared_server()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def post(server, path, body):
    return httpx.post(server.url + path, json={"model": server.model, **body}, timeout=120)


# -- response_format ---------------------------------------------------------------------


def test_openai_client_parse_round_trip(client, server):
    r = client.chat.completions.parse(model=server.model, messages=[{"role": "user", "content": "Invent a person."}],
                                      response_format=Person, temperature=0.8, seed=3, n=3, max_tokens=80)
    assert len(r.choices) == 3
    for choice in r.choices:
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, Person)


def test_json_schema_validates_sampled_n3_on_both_endpoints(server):
    schema = {"type": "object", "properties": {"color": {"enum": ["red", "green"]},
                                               "sizes": {"type": "array", "items": {"type": "integer", "minimum": 1,
                                                                                    "maximum": 9}, "maxItems": 4}},
              "required": ["color", "sizes"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "shirt", "schema": schema}}
    common = {"response_format": fmt, "temperature": 1.0, "seed": 11, "n": 3, "max_tokens": 100}
    texts = [c["message"]["content"] for c in post(server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "A shirt as JSON."}], **common}).json()["choices"]]
    texts += [c["text"] for c in post(server, "/v1/completions", {"prompt": "A shirt as JSON:", **common}
                                      ).json()["choices"]]
    assert len(texts) == 6
    for text in texts:
        jsonschema.validate(json.loads(text), schema)


def test_json_object_and_length_mid_json(server):
    body = {"messages": [{"role": "user", "content": 'Return {"ok": true} as JSON.'}],
            "response_format": {"type": "json_object"}, "temperature": 0}
    full = post(server, "/v1/chat/completions", {**body, "max_tokens": 200}).json()["choices"][0]
    cut = post(server, "/v1/chat/completions", {**body, "max_tokens": 3}).json()["choices"][0]
    assert full["finish_reason"] == "stop" and isinstance(json.loads(full["message"]["content"]), dict)
    assert cut["finish_reason"] == "length"
    assert full["message"]["content"].startswith(cut["message"]["content"])
    assert cut["message"]["content"] not in ("", full["message"]["content"])  # the partial JSON, as OpenAI does


def test_structured_outputs_and_the_guided_aliases_agree(server):
    cases = [({"structured_outputs": {"regex": r"[0-9]{3}-[0-9]{4}"}}, {"guided_regex": r"[0-9]{3}-[0-9]{4}"}),
             ({"structured_outputs": {"choice": ["cat", "dog"]}}, {"guided_choice": ["cat", "dog"]}),
             ({"structured_outputs": {"grammar": 'root ::= "x" [0-9]+'}}, {"guided_grammar": 'root ::= "x" [0-9]+'}),
             ({"structured_outputs": {"json": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}}},
              {"guided_json": json.dumps({"type": "array", "items": {"type": "boolean"}, "maxItems": 3})})]
    for new, old in cases:
        body = {"prompt": "Here it is:", "max_tokens": 12, "temperature": 0}
        a = post(server, "/v1/completions", {**body, **new}).json()["choices"][0]["text"]
        b = post(server, "/v1/completions", {**body, **old}).json()["choices"][0]["text"]
        assert a == b != ""
    assert post(server, "/v1/completions", {"prompt": "Pet:", "max_tokens": 5, "guided_choice": ["cat", "dog"]}
                ).json()["choices"][0]["text"] in ("cat", "dog")


def test_streamed_json_adds_up_to_the_non_streamed_text(client, server):
    kw = {"model": server.model, "messages": [{"role": "user", "content": "A person."}], "temperature": 0,
          "max_tokens": 80, "response_format": {"type": "json_schema", "json_schema": {
              "name": "p", "schema": Person.model_json_schema()}}}
    whole = client.chat.completions.create(**kw).choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw)
                       if c.choices)
    assert streamed == whole and Person.model_validate_json(whole)


# -- tools -------------------------------------------------------------------------------


def test_openai_client_tool_round_trip(client, server):
    tool = openai.pydantic_function_tool(GetWeather)
    first = client.chat.completions.parse(model=server.model, messages=ASK, tools=[tool], tool_choice="required",
                                          parallel_tool_calls=False, temperature=0.7, seed=5, max_tokens=80)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.function.name == "GetWeather" and isinstance(call.function.parsed_arguments, GetWeather)
    # the answer goes back with the call in the history: rendered, and the model replies
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": call.function.name,
                                                         "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "clear"}'}]
    second = client.chat.completions.create(model=server.model, messages=history, tools=[tool], max_tokens=30,
                                            temperature=0)
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_named_tool_choice_forces_that_function(server):
    r = post(server, "/v1/chat/completions", {
        "messages": ASK, "tools": [WEATHER, TIME], "tool_choice": {"type": "function", "function": {"name": "get_time"}},
        "temperature": 1.0, "seed": 2, "n": 3, "max_tokens": 60}).json()
    for choice in r["choices"]:
        assert choice["finish_reason"] == "tool_calls"
        [call] = choice["message"]["tool_calls"]
        assert call["type"] == "function" and call["id"].startswith("call_")
        assert call["function"]["name"] == "get_time"
        jsonschema.validate(json.loads(call["function"]["arguments"]), TIME["function"]["parameters"])


def test_streamed_tool_call_deltas_reassemble_to_the_non_streamed_result(server):
    body = {"messages": ASK, "tools": [WEATHER, TIME], "tool_choice": "required", "temperature": 0,
            "max_tokens": 120}
    whole = post(server, "/v1/chat/completions", body).json()["choices"][0]
    calls: dict[int, dict] = {}
    content, finish = "", None
    with httpx.stream("POST", server.url + "/v1/chat/completions", json={"model": server.model, "stream": True,
                                                                          **body}, timeout=120) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            finish = choice["finish_reason"] or finish
            content += choice["delta"].get("content") or ""
            for d in choice["delta"].get("tool_calls") or ():
                call = calls.setdefault(d["index"], {"name": None, "arguments": ""})
                if "id" in d:
                    assert d["type"] == "function" and d["id"].startswith("call_") and call["name"] is None
                    call["name"] = d["function"]["name"]
                call["arguments"] += d["function"]["arguments"]
    assert whole["finish_reason"] == finish == "tool_calls"
    assert (whole["message"]["content"] or "") == content
    expected = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                for c in whole["message"]["tool_calls"]]
    assert [calls[i] for i in sorted(calls)] == expected and expected
    for c in expected:
        json.loads(c["arguments"])


def test_auto_and_none_leave_the_model_free(server):
    for choice in ("auto", "none"):
        r = post(server, "/v1/chat/completions", {"messages": ASK, "tools": [WEATHER], "tool_choice": choice,
                                                  "temperature": 0, "max_tokens": 20})
        assert r.status_code == 200, r.text
        msg = r.json()["choices"][0]["message"]
        assert msg["role"] == "assistant" and (msg.get("content") is not None or msg.get("tool_calls"))


# -- bad input: one 400 line naming the field, never a 500 -------------------------------


@pytest.mark.parametrize("body, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "array", "uniqueItems": True}}}}, "response_format", ["uniqueItems"]),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format", ["nope"]),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "$ref": "#/$defs/missing"}}}}, "response_format", ["missing"]),
    ({"response_format": {"type": "json_schema"}}, "response_format", ["json_schema"]),
    ({"guided_regex": "(ab"}, "guided_regex", ["regular expression", "unclosed group"]),
    ({"structured_outputs": {"regex": "(?<=a)b"}}, "structured_outputs", ["look-around"]),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", ["exactly one"]),
    ({"guided_json": "{not json"}, "guided_json", ["valid JSON"]),
    ({"guided_grammar": "start: missing_rule"}, "guided_grammar", ["missing_rule"]),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex", ["one output constraint"]),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}],
      "tool_choice": "required"}, "tools", ["bogus"]),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "other"}}}, "tool_choice",
     ["get_weather"]),
    ({"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a"}, "tool_choice", ["one output constraint"]),
    ({"tool_choice": "required"}, "tool_choice", ["without tools"]),
    ({"guided_choice": ["ok", "\U00063539"]}, "guided_choice", ["byte 0xF1"]),
    ({"guided_regex": "a\U00063539"}, None, ["vocabulary"]),  # found while generating: still the request's 400
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools", ["letters"]),
    # impossible: compiles, but no output satisfies it (was a 200 with empty content)
    ({"guided_json": {"$ref": "#"}}, "guided_json", ["admits none"]),
    ({"guided_json": {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}},
     "guided_json", ["admits none"]),
    ({"guided_grammar": "root ::= root"}, "guided_grammar", ["admits none"]),
    # 1.1 MB: refused by its size at once (was 6 s of compiling, then llguidance's panic text)
    ({"guided_json": PATTERNS(18000)}, "guided_json", ["at most 131072 bytes"]),
], ids=["unsupported-keyword", "bad-type", "missing-ref", "no-json_schema", "regex", "look-behind", "two-kinds",
        "json-text", "grammar", "two-fields", "tool-schema", "unknown-tool", "tools-and-regex", "required-no-tools",
        "tool-name", "unwritable-choice", "unwritable-regex", "ref-root", "ref-cycle", "rule-of-itself",
        "huge-schema"])
def test_bad_constraints_are_a_400_naming_the_field(server, body, param, words):
    r = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
                                              **body})
    assert_error(r, 400, *words, param=param)
    assert "\n" not in r.json()["error"]["message"] and "panic" not in r.json()["error"]["message"]
    assert httpx.get(server.url + "/health").status_code == 200
