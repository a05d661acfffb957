"""Tool calling on chat: tools into the prompt, and the grammar that forces a call.

Two ways into the prompt:

- the model's chat template renders tools itself when it reads a `tools`
  variable (Qwen2.5, Hermes, Llama 3.1 ...): it gets the OpenAI tool list and
  assistant messages whose tool calls carry their arguments as objects;
- otherwise (SmolLM2's template, for one) the documented fallback, Hermes
  style: a system block lists the tools as JSON inside <tools></tools> and
  asks for each call as
      <tool_call>
      {"name": "get_weather", "arguments": {"city": "Paris"}}
      </tool_call>
  earlier calls are written back the same way, and tool results go in as a
  user turn of <tool_response></tool_response> blocks.

Calls are read back from that same Hermes form (core/entrypoints/tool_parser.py). For
tool_choice "required" or a named function the output is constrained to it
(forced_call_grammar), each call's arguments by the tool's JSON schema, so
the call is well formed and valid whatever the model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Optional

import jinja2
from jinja2 import meta

from paged.core.engine.structured.params import JSON_LAYOUT

OPEN, CLOSE = "<tool_call>", "</tool_call>"
#: a tool without parameters takes an object with anything in it, as OpenAI reads it
NO_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class Tool:
    name: str
    description: Optional[str] = None
    parameters: dict[str, Any] = field(default_factory=lambda: dict(NO_PARAMETERS))

    def openai(self) -> dict:
        fn: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            fn["description"] = self.description
        fn["parameters"] = self.parameters
        return {"type": "function", "function": fn}


def template_renders_tools(template_source: Optional[str]) -> bool:
    """Whether a chat template reads the `tools` variable (as HF templates
    that support tools do)."""
    if not template_source:
        return False
    try:
        ast = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template_source)
    except jinja2.TemplateSyntaxError:
        return False
    return "tools" in meta.find_undeclared_variables(ast)


# -- the prompt ------------------------------------------------------------------------


def render_call(name: str, arguments: str) -> str:
    """One call in the Hermes form (arguments: JSON text, written as given)."""
    return f'{OPEN}\n{{"name": {json.dumps(name)}, "arguments": {arguments or "{}"}}}\n{CLOSE}'


def tools_system_block(tools: list[Tool]) -> str:
    listed = "\n".join(json.dumps(t.openai(), ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou may call one or more of the functions below to help with the user's request.\n\n"
            f"<tools>\n{listed}\n</tools>\n\n"
            "To call a function, answer with a <tool_call></tool_call> block per call, each holding a JSON "
            "object with the function's name and its arguments:\n"
            f'{OPEN}\n{{"name": "<function name>", "arguments": {{<arguments as JSON>}}}}\n{CLOSE}')


def fallback_messages(messages: list[dict], tools: Optional[list[Tool]]) -> list[dict]:
    """Messages for a template that does not render tools: the tool list in
    the system message, calls and results as Hermes-style text."""
    out: list[dict] = []
    for m in messages:
        if m["role"] == "tool":
            block = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
            if out and out[-1].get("_tool_results"):  # consecutive results share one turn
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_results": True})
        elif m.get("tool_calls"):
            calls = [render_call(c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"]]
            text = "\n".join(([m["content"]] if m.get("content") else []) + calls)
            out.append({k: v for k, v in m.items() if k != "tool_calls"} | {"content": text})
        else:
            out.append(dict(m))
    for m in out:
        m.pop("_tool_results", None)
    if tools:
        block = tools_system_block(tools)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{block}" if out[0]["content"] else block}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


def native_messages(messages: list[dict]) -> list[dict]:
    """Messages for a template that renders tools: call arguments as
    objects (templates write them with tojson)."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = [{**c, "function": {**c["function"], "arguments": _as_object(c["function"]["arguments"])}}
                     for c in m["tool_calls"]]
            m = {**m, "tool_calls": calls}
        out.append(m)
    return out


def _as_object(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


# -- the grammar for a forced call -----------------------------------------------------------


def forced_call_grammar(tools: list[Tool], parallel: bool) -> str:
    """A Lark grammar (llguidance's dialect) whose sentences are Hermes calls
    to `tools`: one, or with `parallel` one or more separated by newlines.
    The name is fixed text; the arguments follow the tool's schema (%json)."""
    rules = []
    for i, tool in enumerate(tools):
        head = f'{OPEN}\n{{"name": {json.dumps(tool.name)}, "arguments": '
        rules.append(f"call_{i}: {json.dumps(head)} args_{i} {json.dumps('}' + chr(10) + CLOSE)}")
        schema = {**tool.parameters, "x-guidance": JSON_LAYOUT}  # %json takes its options in the schema
        rules.append(f"args_{i}: %json {json.dumps(schema)}")
    start = 'start: call ("\\n" call)*' if parallel else "start: call"
    calls = "call: " + " | ".join(f"call_{i}" for i in range(len(tools)))
    return "\n".join([start, calls, *rules])
