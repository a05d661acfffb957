"""Structured output and tool calls at the API boundary: a request's one
output constraint, compiled before it is submitted, and tool calls parsed
out of chat outputs into OpenAI's shapes.

    constraint = await request_constraint(compiler, req)       # None, or compiled; 400 if bad
    message, finish = chat_message(output, tool_names)          # non-streamed choice
    delta, finish = chat_delta(output, sent, ToolCallStream(...))  # streamed choice
"""

from __future__ import annotations

import asyncio
from typing import Optional

from paged.core.engine.sampling_params import StructuredOutputsParams
from paged.core.entrypoints.server import protocol as P
from paged.core.entrypoints.server.errors import bad_request, expected, param_named_in
from paged.core.engine.structured.compiler import GrammarCompiler, GrammarError
from paged.core.entrypoints.tool_parser import ToolCallStream, call_id, parse_tool_calls
from paged.core.entrypoints.tools import Tool, forced_call_grammar


async def request_constraint(compiler: GrammarCompiler, req: P.SamplingFields, forced: list[Tool] = (),
                             parallel: bool = False) -> Optional[StructuredOutputsParams]:
    """The request's one constraint, compiled (a 400 naming the field when it
    is malformed, does not compile, or comes with another). `forced`: the
    tools tool_choice makes the model call (`parallel`: one call or more)."""
    try:
        found = req.constraints()
    except ValueError as exc:
        raise bad_request(str(exc), param_named_in(str(exc), type(req))) from None
    if forced:
        found.append(("tool_choice", await forced_call(compiler, forced, parallel)))
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise expected(found[1][0], "one output constraint per request", names, found[1][0])
    if not found:
        return None
    param, constraint = found[0]
    await compile_for(compiler, constraint, param)
    return constraint


async def compile_for(compiler: GrammarCompiler, constraint: StructuredOutputsParams, param: str) -> None:
    """Compiles on the grammar thread (the event loop waits, the engine steps
    on). Submitting runs off the loop too: it writes the constraint's text
    (the cache key), milliseconds for a large schema."""
    try:
        submitted = await asyncio.get_running_loop().run_in_executor(None, compiler.submit, constraint, param)
        await asyncio.wrap_future(submitted)
    except GrammarError as exc:
        raise bad_request(str(exc), param.partition(".")[0].partition("[")[0]) from None


async def forced_call(compiler: GrammarCompiler, tools: list[Tool], parallel: bool) -> StructuredOutputsParams:
    """tool_choice "required" or a named function: the output is Hermes calls
    whose arguments follow each tool's schema (each schema compiled alone
    first, so a bad one is named)."""
    for i, tool in enumerate(tools):
        await compile_for(compiler, StructuredOutputsParams(json=tool.parameters), f"tools[{i}].function.parameters")
    return StructuredOutputsParams(grammar=forced_call_grammar(tools, parallel))


def chat_message(o, names: Optional[set[str]]) -> tuple[dict, Optional[str]]:
    """The assistant message and finish_reason of one choice; with tools in
    play (`names`), the calls parsed out of the text ("tool_calls" when any)."""
    if names is None:
        return {"role": "assistant", "content": o.text}, o.finish_reason
    parsed = parse_tool_calls(o.text, names, final=True)
    if not parsed.calls:
        return {"role": "assistant", "content": parsed.content}, o.finish_reason
    calls = [{"id": call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
             for c in parsed.calls]
    finish = "tool_calls" if o.finish_reason == "stop" else o.finish_reason
    return {"role": "assistant", "content": parsed.content or None, "tool_calls": calls}, finish


def chat_delta(o, start_text: int, stream: Optional[ToolCallStream]) -> tuple[dict, Optional[str]]:
    """One choice's delta since `start_text` characters and its finish_reason;
    with tools in play, content and tool_call deltas from the parse."""
    if stream is None:
        text = o.text[start_text:]
        return ({"content": text} if text else {}), o.finish_reason
    content, calls = stream.update(o.text, final=o.finish_reason is not None)
    delta = ({"content": content} if content else {}) | ({"tool_calls": calls} if calls else {})
    finish = "tool_calls" if o.finish_reason == "stop" and stream.num_calls else o.finish_reason
    return delta, finish
