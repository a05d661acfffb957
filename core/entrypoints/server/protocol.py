"""Request and response bodies of the OpenAI-compatible API (pydantic v2).

These models are the boundary: everything a request can carry is checked
here, and they are also what /openapi.json publishes.

- Types are strict: "10" is no integer, "yes" no bool, true no token id;
  numbers must be finite. A whole-number float (2.0) is an integer, as
  JSON Schema says and /openapi.json promises; 2.5 is not. Failures become 400s in the form
  `field: expected X, got Y` (server/errors.py).
- An OpenAI or vLLM field we do not support is refused with a 400 naming it
  unless its value changes nothing (`audio: null`, `suffix: ""`, ...):
  silently ignoring it would change the output the client asked for.
  Fields that never change the output (`user`, `store`, `metadata`, ...)
  are accepted; fields nobody declared are ignored (clients add new ones
  all the time).
- Structured output (`response_format`, vLLM's `structured_outputs` and its
  older `guided_*` aliases) and tools are checked for shape here; whether a
  schema or regex compiles is the grammar compiler's call (a 400 as well,
  from server/app.py).
"""

from __future__ import annotations

import re
import time
import uuid
from typing import Annotated, Any, Callable, Literal, Optional, Union

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, WrapValidator,
                      field_validator, model_validator)
from pydantic_core import PydanticCustomError

from paged.core.engine.sampling_params import MAX_LOGIT_BIAS, MAX_LOGPROBS, SEED_MAX, SEED_MIN, StructuredOutputsParams
from paged.core.entrypoints.tools import Tool


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def _expected(what: str) -> PydanticCustomError:
    return PydanticCustomError("expected", "expected {what}", {"what": what})


def expect(what: str) -> WrapValidator:
    """One `expected <what>` for a union instead of pydantic's error per member."""
    def check(value, handler):
        try:
            return handler(value)
        except ValidationError:
            raise _expected(what) from None
    return WrapValidator(check)


def only_if(no_op: Callable[[Any], bool], what: str) -> AfterValidator:
    """An unsupported field: accepted only with a value that changes nothing."""
    def check(value):
        if not no_op(value):
            raise _expected(what)
        return value
    return AfterValidator(check)


def _non_empty(strings: Union[str, list[str], None]):
    if strings == "" or (isinstance(strings, list) and "" in strings):
        raise _expected("non-empty stop strings")
    return strings


def _absent(value) -> bool:
    return value is None


def _absent_or_empty(value) -> bool:
    return not value


_TOOLS = "the deprecated functions API is not supported: use tools"


def _whole(value):
    """JSON Schema's integer: 2.0 is one; 2.5, "2" and true are not."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


#: an integer field: strict, but a whole-number float counts
Int = Annotated[int, BeforeValidator(_whole)]


class _Request(BaseModel):
    # strict: no coercion of "10" / "yes" / true; allow_inf_nan: finite numbers only
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class StreamOptions(_Request):
    include_usage: bool = False


class JsonSchemaFormat(_Request):
    name: str = Field(..., min_length=1, max_length=64)
    description: Optional[str] = None
    schema_: Optional[dict[str, Any]] = Field(None, alias="schema", description="the JSON schema; absent: any JSON")
    strict: Optional[bool] = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None

    @model_validator(mode="after")
    def _schema_for_json_schema(self):
        if self.json_schema is None and self.type == "json_schema":
            raise _expected('a json_schema object ({"name": ..., "schema": {...}}) with type "json_schema"')
        return self

    def constraint(self) -> Optional[StructuredOutputsParams]:
        if self.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if self.type == "json_schema":
            schema = self.json_schema.schema_
            return StructuredOutputsParams(json=schema if schema is not None else {})
        return None


SchemaValue = Annotated[Union[dict[str, Any], str], expect("a JSON schema (an object, or its JSON text)")]
Choices = Annotated[list[str], Field(min_length=1)]


class StructuredOutputs(_Request):
    """vLLM's structured_outputs object: exactly one constraint."""

    json_: Optional[SchemaValue] = Field(None, alias="json")
    regex: Optional[str] = Field(None, min_length=1)
    choice: Optional[Choices] = None
    grammar: Optional[str] = Field(None, min_length=1)
    json_object: Optional[bool] = None
    # accepted, change nothing: one backend (no fallback), JSON never has free whitespace
    disable_fallback: Optional[bool] = None
    disable_any_whitespace: Optional[bool] = None
    disable_additional_properties: Annotated[Optional[bool], only_if(_absent_or_empty, "false (not supported)")] \
        = None
    whitespace_pattern: Annotated[Optional[Any], only_if(_absent, "null (not supported)")] = None
    structural_tag: Annotated[Optional[Any], only_if(_absent, "null (not supported)")] = None

    def constraint(self) -> StructuredOutputsParams:
        return StructuredOutputsParams(json=self.json_, regex=self.regex, choice=self.choice,
                                       grammar=self.grammar, json_object=self.json_object or None)


Stop = Annotated[Optional[Union[str, list[str]]], expect("a string or a list of strings"),
                 AfterValidator(_non_empty)]
LogitBias = dict[str, Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]]


class SamplingFields(_Request):
    """Sampling fields shared by completions and chat completions."""

    model: Optional[str] = None
    n: Int = Field(1, ge=1, le=128)
    temperature: Optional[float] = Field(None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)
    stop: Stop = None
    seed: Optional[Int] = Field(None, ge=SEED_MIN, le=SEED_MAX)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: Optional[LogitBias] = Field(None, description="token id (as a string) -> bias in [-100, 100]")
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    response_format: Optional[ResponseFormat] = None
    # vLLM extensions
    ignore_eos: bool = False
    min_tokens: Int = Field(0, ge=0)
    top_k: Optional[Int] = Field(None, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    stop_token_ids: Optional[list[Annotated[Int, Field(ge=0)]]] = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: Optional[StructuredOutputs] = None
    # vLLM's older names for structured_outputs' fields
    guided_json: Optional[SchemaValue] = None
    guided_regex: Optional[str] = Field(None, min_length=1)
    guided_choice: Optional[Choices] = None
    guided_grammar: Optional[str] = Field(None, min_length=1)
    use_beam_search: Annotated[Optional[bool], only_if(_absent_or_empty, "false (no beam search)")] = None
    prompt_logprobs: Annotated[Optional[Any], only_if(_absent, "null (prompt logprobs are not returned)")] = None

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, bias):
        bad = next((k for k in bias or () if not (k.isascii() and k.isdigit())), None)
        if bad is not None:
            raise _expected("token ids (decimal strings) as keys")
        return bias

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def logit_bias_ids(self) -> Optional[dict[int, float]]:
        return None if self.logit_bias is None else {int(k): v for k, v in self.logit_bias.items()}

    def constraints(self) -> list[tuple[str, StructuredOutputsParams]]:
        """(field, constraint) for every field that constrains the output;
        raises ValueError (naming the field) for a malformed one."""
        found = []
        for name, make in (("response_format", lambda v: v.constraint()),
                           ("structured_outputs", lambda v: v.constraint()),
                           ("guided_json", lambda v: StructuredOutputsParams(json=v)),
                           ("guided_regex", lambda v: StructuredOutputsParams(regex=v)),
                           ("guided_choice", lambda v: StructuredOutputsParams(choice=v)),
                           ("guided_grammar", lambda v: StructuredOutputsParams(grammar=v))):
            value = getattr(self, name)
            if value is None:
                continue
            try:
                constraint = make(value)
            except ValueError as exc:  # name the request's field, not SamplingParams'
                where, _, problem = str(exc).partition(": ")
                raise ValueError(f"{where if name == 'structured_outputs' else name}: {problem}") from None
            if constraint is not None:
                found.append((name, constraint))
        return found


Text = Annotated[str, Field(min_length=1)]
TokenIds = Annotated[list[Int], Field(min_length=1)]
# non-empty throughout: an empty prompt has no token to continue from (the
# model has no BOS token to stand in for it)
PromptType = Annotated[Union[Text, Annotated[list[Text], Field(min_length=1)], TokenIds,
                             Annotated[list[TokenIds], Field(min_length=1)]],
                       expect("a string, a list of strings, a list of token ids or a list of token-id lists")]


def _best_of_schema(schema: dict) -> None:
    """Published as null: n itself is accepted too (vLLM's clients send it),
    any other value never is."""
    schema.pop("anyOf", None)
    schema["type"] = "null"


class CompletionRequest(SamplingFields):
    prompt: PromptType
    max_tokens: Optional[Int] = Field(16, ge=1)
    echo: bool = False
    logprobs: Optional[Int] = Field(None, ge=0, le=MAX_LOGPROBS)
    suffix: Annotated[Optional[str], only_if(_absent_or_empty, "null (suffix is not supported)")] = None
    best_of: Optional[Int] = Field(None, ge=1, json_schema_extra=_best_of_schema,
                                   description="null, or equal to n: one sample per choice (no best-of ranking)")

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_not_empty(cls, v):
        if v == "" or (isinstance(v, list) and "" in v):
            raise _expected("non-empty text (an empty prompt has no token to continue from)")
        if v == []:
            raise _expected("a non-empty list")
        if isinstance(v, list) and any(p == [] for p in v):
            raise _expected("non-empty token-id prompts")
        return v

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, v, info):
        if v is not None and v != info.data.get("n", 1):
            raise _expected(f"null or n ({info.data.get('n', 1)}): one sample per choice, no best-of ranking")
        return v

    def prompts(self) -> list[Union[str, list[int]]]:
        """The prompt as a list of single prompts (text or token ids)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)


class TextPart(_Request):
    type: Literal["text"]
    text: str


_FUNCTION_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")


def _function_name(name: str) -> str:
    if not _FUNCTION_NAME.fullmatch(name):
        raise _expected("a name of 1 to 64 letters, digits, '_' or '-'")
    return name


FunctionName = Annotated[str, AfterValidator(_function_name)]


class FunctionDefinition(_Request):
    name: FunctionName
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = Field(None, description="a JSON schema; absent: no parameters")
    strict: Optional[bool] = None


class ToolDefinition(_Request):
    type: Literal["function"]
    function: FunctionDefinition

    def tool(self) -> Tool:
        fn = self.function
        return Tool(fn.name, fn.description) if fn.parameters is None else Tool(fn.name, fn.description, fn.parameters)


class FunctionChoice(_Request):
    name: FunctionName


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: FunctionChoice


class FunctionCall(_Request):
    name: str
    arguments: str = Field(..., description="the arguments as JSON text")


class ToolCall(_Request):
    id: str
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(_Request):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Annotated[Optional[Union[str, list[TextPart]]],
                       expect('a string or a list of {"type": "text", "text": ...} parts '
                              "(only text is supported)")] = None
    name: Optional[str] = None
    tool_call_id: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = None
    function_call: Annotated[Optional[Any], only_if(_absent, f"null ({_TOOLS})")] = None

    def text(self) -> str:
        """Content as plain text (OpenAI's list-of-parts form joined)."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part.text for part in self.content)

    def for_template(self) -> dict[str, Any]:
        msg: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            msg["name"] = self.name
        if self.tool_call_id is not None:
            msg["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            msg["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        return msg


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: Optional[Int] = Field(None, ge=1)
    max_completion_tokens: Optional[Int] = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: Optional[Int] = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    tools: Optional[list[ToolDefinition]] = None
    tool_choice: Annotated[Optional[Union[Literal["none", "auto", "required"], NamedToolChoice]],
                           expect('"none", "auto", "required" or {"type": "function", "function": {"name": ...}}')] \
        = None
    parallel_tool_calls: Optional[bool] = None
    functions: Annotated[Optional[list[Any]], only_if(_absent_or_empty, f"no functions ({_TOOLS})")] = None
    function_call: Annotated[Optional[Any], only_if(lambda v: v in (None, "none"), f'null or "none" ({_TOOLS})')] \
        = None
    modalities: Annotated[Optional[list[str]], only_if(lambda v: v in (None, ["text"]), '["text"]')] = None
    audio: Annotated[Optional[Any], only_if(_absent, "null (audio output is not supported)")] = None
    reasoning_effort: Annotated[Optional[Any], only_if(_absent, "null (not a reasoning model)")] = None
    web_search_options: Annotated[Optional[Any], only_if(_absent, "null (web search is not supported)")] = None
    store: Optional[bool] = None
    metadata: Optional[dict[str, str]] = None
    service_tier: Optional[str] = None

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice_has_tools(cls, choice, info):
        names = [t.function.name for t in info.data.get("tools") or ()]
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise _expected(f"the name of a function in tools ({', '.join(names) or 'none given'})")
        if choice == "required" and not names:
            raise _expected('"none" or "auto" without tools')
        return choice

    def tool_list(self) -> list[Tool]:
        return [t.tool() for t in self.tools or ()]

    def forced_tools(self) -> list[Tool]:
        """The tools a call must go to: all of them for "required", the named
        one; none otherwise."""
        mode = self.tool_mode()
        if mode == "named":
            return [t for t in self.tool_list() if t.name == self.tool_choice.function.name]
        return self.tool_list() if mode == "required" else []

    def tool_mode(self) -> str:
        """"none" (no tools in play), "auto", "required" or "named"."""
        if not self.tools or self.tool_choice == "none":
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or "auto"

    def effective_max_tokens(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(_Request):
    """Exactly one of prompt and messages (the schema's oneOf says so)."""

    model_config = ConfigDict(**_Request.model_config, json_schema_extra={"oneOf": [
        {"required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
        {"required": ["messages"], "properties": {"messages": {"type": "array"}}}]})
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Request):
    model: Optional[str] = None
    tokens: list[Annotated[Int, Field(ge=0)]]


#: the request body of each POST route, for the handlers and /openapi.json
REQUEST_BODIES: dict[str, type[BaseModel]] = {
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
    "/tokenize": TokenizeRequest,
    "/detokenize": DetokenizeRequest,
}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Union[str, int, None] = None


class ErrorResponse(BaseModel):
    """Every error, OpenAI's shape."""

    error: ErrorDetail


# -- responses (plain dict builders keep the JSON exactly as OpenAI spells it)


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def now() -> int:
    return int(time.time())
