"""The Hermes tool-call parser and the tool prompt helpers (core/entrypoints/tool_parser.py,
core/entrypoints/tools.py).

Oracle for streaming: for every way of splitting a text into chunks, the
deltas ToolCallStream sends add up to the parse of the whole text; for the
parse itself, hand-written expectations.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paged.core.engine.sampling_params import StructuredOutputsParams
from paged.core.engine.structured.compiler import GrammarCompiler
from paged.core.entrypoints.tool_parser import ToolCallStream, parse_tool_calls
from paged.core.entrypoints.tools import Tool, fallback_messages, forced_call_grammar, template_renders_tools

NAMES = {"get_weather", "get_time"}
CALL_W = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "odd": "a}b\\"c{"}}\n</tool_call>'
CALL_T = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
TEXTS = [
    f"Let me check.\n{CALL_W}\n{CALL_T}",
    f"{CALL_W}\nDone.",
    "no calls here, only <b>markup</b> and a trailing <tool_c",
    '<tool_call>{"name": "unknown", "arguments": {}}</tool_call> after',
    "<tool_call>not json</tool_call>",
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',  # cut by max_tokens
    '<tool_call>\n{"name": " get_time", "arguments": {}}</tool_call>',  # a name with a space is no tool's
]


def replay(text: str, cuts: list[int]) -> tuple[str, list[tuple[str, str]]]:
    """Content and (name, arguments) per call, rebuilt from stream deltas."""
    stream, content, calls = ToolCallStream(NAMES), "", {}
    ends = sorted(set(c for c in cuts if 0 < c < len(text))) + [len(text)]
    for end in ends:
        delta, deltas = stream.update(text[:end], final=end == len(text))
        content += delta
        for d in deltas:
            call = calls.setdefault(d["index"], ["", ""])
            if "id" in d:
                assert d["id"].startswith("call_") and d["type"] == "function" and call == ["", ""]
                call[0] = d["function"]["name"]
            call[1] += d["function"]["arguments"]
    return content, [tuple(calls[i]) for i in sorted(calls)]


def whole(text: str) -> tuple[str, list[tuple[str, str]]]:
    parsed = parse_tool_calls(text, NAMES, final=True)
    return parsed.content, [(c.name, c.arguments) for c in parsed.calls]


def test_calls_and_content_are_read_verbatim():
    content, calls = whole(TEXTS[0])
    assert content == "Let me check."
    assert calls == [("get_weather", '{"city": "Paris", "odd": "a}b\\"c{"}'), ("get_time", "{}")]
    assert json.loads(calls[0][1]) == {"city": "Paris", "odd": 'a}b"c{'}
    assert whole(TEXTS[1]) == ("Done.", [calls[0]])


@pytest.mark.parametrize("text", TEXTS[2:5] + TEXTS[6:])
def test_what_is_not_a_call_stays_content_verbatim(text):
    assert whole(text) == (text.strip(), [])


def test_a_call_cut_short_keeps_its_partial_arguments():
    parsed = parse_tool_calls(TEXTS[5], NAMES, final=True)
    assert [(c.name, c.arguments, c.complete) for c in parsed.calls] == [("get_weather", '{"city": "Par', False)]


@pytest.mark.parametrize("text", TEXTS)
def test_token_by_character_deltas_add_up_to_the_whole(text):
    assert replay(text, list(range(len(text)))) == whole(text)


@settings(max_examples=200, derandomize=True, database=None)
@given(st.sampled_from(TEXTS), st.lists(st.integers(min_value=1, max_value=200), max_size=12))
def test_any_chunking_adds_up_to_the_whole(text, cuts):
    assert replay(text, cuts) == whole(text)


def test_fallback_prompt_lists_tools_and_writes_calls_and_results_back():
    tool = Tool("get_time", "The local time", {"type": "object", "properties": {"city": {"type": "string"}}})
    call = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"city": "Oslo"}'}}
    msgs = fallback_messages([{"role": "system", "content": "Be brief."},
                              {"role": "user", "content": "Time in Oslo?"},
                              {"role": "assistant", "content": "", "tool_calls": [call]},
                              {"role": "tool", "tool_call_id": "call_1", "content": "09:00"},
                              {"role": "tool", "tool_call_id": "call_2", "content": "10:00"}], [tool])
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user"]
    assert msgs[0]["content"].startswith("Be brief.\n\n# Tools") and '"name": "get_time"' in msgs[0]["content"]
    assert whole(msgs[2]["content"]) == ("", [("get_time", '{"city": "Oslo"}')])  # read back as it was written
    assert msgs[3]["content"] == "<tool_response>\n09:00\n</tool_response>\n<tool_response>\n10:00\n</tool_response>"


def test_template_tool_support_is_read_from_the_template():
    assert template_renders_tools("{% if tools %}{{ tools | tojson }}{% endif %}{{ messages[0].content }}")
    assert not template_renders_tools("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert not template_renders_tools(None)


def test_forced_call_grammar_compiles_and_names_every_tool(default_model_fp32):
    tools = [Tool("get_weather"), Tool("get_time", None, {"type": "object", "properties": {"city": {
        "type": "string"}}, "required": ["city"]})]
    compiler = GrammarCompiler(default_model_fp32.tokenizer, default_model_fp32.config.vocab_size, [2])
    for parallel in (False, True):
        matcher = compiler.compile(StructuredOutputsParams(grammar=forced_call_grammar(tools, parallel))).deep_copy()
        text = '<tool_call>\n{"name": "get_time", "arguments": {"city": "Oslo"}}\n</tool_call>'
        ids = default_model_fp32.tokenizer.encode(text, add_special_tokens=False)
        assert matcher.consume_tokens(ids) and matcher.is_accepting()
        assert matcher.is_stopped() != parallel  # one call: complete; several: another may follow
