"""Structured output in the engine (issue 20), with the real default model
and real llguidance.

Oracles: the jsonschema package for generated JSON, Python's re for regex
output, the same prompt run alone for batching and preemption (float32 CPU
kernels are batch invariant), and the grammar thread held on an Event for
the ordering of compilation against other requests' steps (no clocks).
"""

from __future__ import annotations

import json
import os
import re
import threading

import jsonschema
import pytest

from conftest import step_until_idle

from paged.core.engine.engine import Engine
from paged.core.engine.config import EngineConfig
from paged.core.entrypoints.llm import LLM
from paged.core.engine.sampling_params import SamplingParams, StructuredOutputsParams
from paged.core.engine.structured.compiler import GrammarError

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "minLength": 1, "maxLength": 20},
    "age": {"type": "integer", "minimum": 0, "maximum": 120}},
    "required": ["name", "age"], "additionalProperties": False}
SCHEMAS = {
    "person": PERSON,
    "enum_and_bool": {"type": "object", "properties": {
        "color": {"enum": ["red", "green", "blue"]}, "bright": {"type": "boolean"}},
        "required": ["color", "bright"], "additionalProperties": False},
    "list": {"type": "object", "properties": {
        "items": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 3}},
        "required": ["items"], "additionalProperties": False},
    "nested": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20},
        "where": {"type": "object", "properties": {"lat": {"type": "number", "minimum": -90, "maximum": 90},
                                                   "north": {"type": "boolean"}},
                  "required": ["lat", "north"], "additionalProperties": False}},
        "required": ["city", "where"], "additionalProperties": False},
}
FREE_PROMPTS = ["The capital of France is", "def fib(n):", "Once upon a time"]
GREEDY_FREE = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def as_json(schema) -> StructuredOutputsParams:
    return StructuredOutputsParams(json=schema)


def chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


@pytest.fixture(scope="module")
def engine(default_model_path):
    return Engine(EngineConfig(model=str(default_model_path), device="cpu", dtype="float32", max_model_len=512,
                               max_num_seqs=16, max_num_batched_tokens=256, kv_cache_memory="128MiB",
                               block_size=16, cpu_threads_bind=str(min(os.sched_getaffinity(0)))))


@pytest.fixture(scope="module")
def llm(engine):
    return LLM.from_engine(engine)


# -- outputs are valid ------------------------------------------------------------------


@pytest.mark.parametrize("name", SCHEMAS)
def test_sampled_json_parses_and_validates_n3(llm, name):
    schema = SCHEMAS[name]
    params = SamplingParams(temperature=0.9, n=3, seed=7, max_tokens=160, structured_outputs=as_json(schema))
    out = llm.chat(chat(f"Write a {name} as JSON."), params)[0]
    assert len(out.outputs) == 3
    for o in out.outputs:
        assert o.finish_reason == "stop", o.text
        jsonschema.validate(json.loads(o.text), schema)


def test_json_object_regex_choice_and_gbnf_grammar(llm):
    prompts = ["A JSON object:", "My phone number is", "The sky is", "Answer yes or no:"]
    params = [SamplingParams(temperature=0.7, seed=1, max_tokens=120,
                             structured_outputs=StructuredOutputsParams(json_object=True)),
              SamplingParams(temperature=0.7, seed=2, max_tokens=20,
                             structured_outputs=StructuredOutputsParams(regex=r"\d{3}-\d{4}")),
              SamplingParams(temperature=0.7, seed=3, max_tokens=20,
                             structured_outputs=StructuredOutputsParams(choice=["blue", "grey", "green"])),
              SamplingParams(temperature=0.7, seed=4, max_tokens=20,
                             structured_outputs=StructuredOutputsParams(grammar='root ::= ("yes" | "no") "!"'))]
    obj, phone, sky, yes_no = (o.outputs[0] for o in llm.generate(prompts, params))
    assert obj.finish_reason == "stop" and isinstance(json.loads(obj.text), dict), obj.text
    assert re.fullmatch(r"\d{3}-\d{4}", phone.text)
    assert sky.text in ("blue", "grey", "green")
    assert yes_no.text in ("yes!", "no!")


def test_max_tokens_mid_json_finishes_with_length_and_the_partial(llm):
    params = SamplingParams(temperature=0.0, max_tokens=4, structured_outputs=as_json(PERSON))
    full = llm.chat(chat("A person as JSON."), SamplingParams(temperature=0.0, max_tokens=100,
                                                              structured_outputs=as_json(PERSON)))[0].outputs[0]
    cut = llm.chat(chat("A person as JSON."), params)[0].outputs[0]
    assert cut.finish_reason == "length" and len(cut.token_ids) == 4
    assert full.text.startswith(cut.text) and cut.text != full.text  # the partial, as generated


def test_stop_string_ends_constrained_output(llm):
    base = SamplingParams(temperature=0.0, max_tokens=100, structured_outputs=as_json(PERSON))
    full = llm.chat(chat("A person as JSON."), base)[0].outputs[0].text
    stopped = llm.chat(chat("A person as JSON."), SamplingParams(
        temperature=0.0, max_tokens=100, stop=", ", structured_outputs=as_json(PERSON)))[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == ", "
    assert stopped.text == full[:full.index(", ")]


# -- batching, preemption ------------------------------------------------------------------


def test_free_requests_batched_with_constrained_ones_equal_alone(llm):
    alone = [o.outputs[0].token_ids for o in llm.generate(FREE_PROMPTS, GREEDY_FREE)]
    constrained = SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=as_json(PERSON))
    prompts = [FREE_PROMPTS[0], "A person:", FREE_PROMPTS[1], "Another person:", FREE_PROMPTS[2]]
    outs = llm.generate(prompts, [GREEDY_FREE, constrained, GREEDY_FREE, constrained, GREEDY_FREE])
    assert [outs[i].outputs[0].token_ids for i in (0, 2, 4)] == alone
    for i in (1, 3):
        jsonschema.validate(json.loads(outs[i].outputs[0].text), PERSON)


def test_constrained_output_is_unchanged_by_preemption(llm, engine):
    params = SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=as_json(SCHEMAS["nested"]))
    prompts = [f"Place number {i} as JSON:" for i in range(6)]
    alone = [llm.generate(p, params)[0].outputs[0].token_ids for p in prompts]
    kv = engine.kv_cache_manager
    hog = kv.num_free_blocks - 6  # 6 sequences of ~30-70 tokens need more: the newest are preempted
    assert kv.allocate_slots("hog", [0] * (hog * kv.block_size), 0, hog * kv.block_size) is not None
    try:
        before = engine.scheduler.num_preemptions
        outs = llm.generate(prompts, params)
        assert engine.scheduler.num_preemptions > before
    finally:
        kv.free("hog")
    assert [o.outputs[0].token_ids for o in outs] == alone


# -- compilation: off the engine thread, errors ---------------------------------------------


def test_other_requests_step_while_a_compilation_is_pending(engine):
    gate = threading.Event()
    engine.grammars.compiler.pool.submit(gate.wait)  # the grammar thread is busy until released
    schema = {**PERSON, "title": "pending-test"}  # a constraint not compiled before
    try:
        engine.add_request("free", FREE_PROMPTS[0], GREEDY_FREE)
        engine.add_request("constrained", "A person:", SamplingParams(
            temperature=0.0, max_tokens=60, structured_outputs=as_json(schema)))
        seen = {}
        while "free" not in seen:
            seen.update({o.request_id: o for o in engine.step() if o.finished})
        assert "constrained" in engine.grammars  # still compiling, while "free" ran to its end
        assert len(seen["free"].outputs[0].token_ids) == GREEDY_FREE.max_tokens
    finally:
        gate.set()
    final, failures = step_until_idle(engine)
    assert not failures
    jsonschema.validate(json.loads(final["constrained"].outputs[0].text), schema)


def test_a_large_constraint_never_delays_a_small_one(engine):
    """Large constraints compile on their own lane: one held there (a slow
    client's schema) leaves small ones compiling on theirs."""
    from test_structured_server import PATTERNS

    compiler, gate = engine.grammars.compiler, threading.Event()
    large, small = as_json({**PATTERNS(400), "title": "lane-test"}), as_json({**PERSON, "title": "lane-test"})
    compiler.lane_for(large).submit(gate.wait)  # the large lane is busy until released
    try:
        large_done = compiler.submit(large)
        compiler.submit(small).result(timeout=60)
        assert not large_done.done()
    finally:
        gate.set()
    large_done.result(timeout=60)
    assert compiler.lane_for(small) is compiler.pool is not compiler.lane_for(large)


def test_llguidance_panic_text_never_reaches_a_client():
    """The text llguidance 1.9.1 gave a 680 KB schema (after 6.6 s; the size
    limit refuses such schemas before compiling now) became one plain line."""
    from paged.core.engine.structured.compiler import INTERNAL_LIMIT, _one_line

    assert _one_line("panic: assertion failed: grammar.symbols.len() < u16::MAX as usize - 10") == INTERNAL_LIMIT
    assert _one_line("error: unclosed group\n  (ab\n  ^") == "unclosed group"


def test_abort_while_compiling(engine):
    gate = threading.Event()
    engine.grammars.compiler.pool.submit(gate.wait)
    try:
        engine.add_request("gone", "A person:", SamplingParams(
            structured_outputs=as_json({**PERSON, "title": "abort-test"})))
        out = engine.abort_request("gone")
    finally:
        gate.set()
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("constraint, problem", [
    (StructuredOutputsParams(regex="(ab"), "unclosed group"),
    (StructuredOutputsParams(regex="(?=a)b"), "look-around"),
    (StructuredOutputsParams(json={"type": "array", "uniqueItems": True}), "uniqueItems"),
    (StructuredOutputsParams(json={"type": "integer", "minimum": 5, "maximum": 1}), "minimum"),
    (StructuredOutputsParams(json={"type": "strange"}), "strange"),
    (StructuredOutputsParams(grammar="start: nowhere"), "nowhere"),
], ids=["regex", "look-around", "unsupported-keyword", "unsatisfiable", "bad-type", "grammar"])
def test_a_constraint_that_does_not_compile_is_one_clear_value_error(llm, constraint, problem):
    with pytest.raises(ValueError, match=problem) as info:
        llm.generate("x", SamplingParams(structured_outputs=constraint))
    assert "\n" not in str(info.value) and str(info.value).startswith("structured_outputs: expected ")


def test_a_failing_compilation_fails_only_its_request(engine):
    """Straight into the engine (no LLM pre-compile): the compilation fails
    on the grammar thread, the request fails alone."""
    engine.add_request("bad", "x", SamplingParams(structured_outputs=StructuredOutputsParams(regex="[z-a]")))
    engine.add_request("good", FREE_PROMPTS[1], GREEDY_FREE)
    final, failures = step_until_idle(engine)
    assert list(failures) == ["bad"] and "regular expression" in str(failures["bad"])
    assert len(final["good"].outputs[0].token_ids) == GREEDY_FREE.max_tokens
    with pytest.raises(ValueError, match="regular expression"):  # known bad now: refused at once
        engine.add_request("bad-again", "x", SamplingParams(
            structured_outputs=StructuredOutputsParams(regex="[z-a]")))


# U+63539 starts with byte 0xF1, which no token of SmolLM2's vocabulary holds
UNWRITABLE = "\U00063539"


def test_a_choice_the_vocabulary_cannot_write_is_refused_up_front(llm):
    with pytest.raises(ValueError, match="structured_outputs.choice: .*byte 0xF1 .no token holds it."):
        llm.generate("x", SamplingParams(structured_outputs=StructuredOutputsParams(choice=["ok", UNWRITABLE])))


def test_a_grammar_the_vocabulary_cannot_continue_fails_its_request_as_a_grammar_error(engine):
    engine.add_request("stuck", "x", SamplingParams(structured_outputs=StructuredOutputsParams(
        regex="a" + UNWRITABLE)))
    engine.add_request("fine", FREE_PROMPTS[2], GREEDY_FREE)
    final, failures = step_until_idle(engine)
    assert list(failures) == ["stuck"] and isinstance(failures["stuck"], GrammarError)
    assert "vocabulary" in str(failures["stuck"]) and "\n" not in str(failures["stuck"])
    assert len(final["fine"].outputs[0].token_ids) == GREEDY_FREE.max_tokens


@pytest.mark.parametrize("kwargs, message", [
    ({}, "exactly one of"),
    ({"json": {}, "regex": "a"}, "exactly one of"),
    ({"json": "[1, 2]"}, "structured_outputs.json: expected a JSON schema object"),
    ({"json": "{oops"}, "valid JSON text"),
    ({"choice": []}, "non-empty list of strings"),
    ({"regex": ""}, "non-empty string"),
])
def test_structured_outputs_params_shapes(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        StructuredOutputsParams(**kwargs)
    with pytest.raises(ValueError, match="structured_outputs: expected a StructuredOutputsParams"):
        SamplingParams(structured_outputs={"json": {}})
