"""Request and response bodies of the OpenAI-compatible API (pydantic v2).

These models are the boundary: everything a request can carry is checked
here, and they are also what /openapi.json publishes.

- Types are strict: "10" is no integer, "yes" no bool, true no token id;
  numbers must be finite. Failures become 400s in the form
  `field: expected X, got Y` (server/errors.py).
- An OpenAI or vLLM field we do not support is refused with a 400 naming it
  unless its value changes nothing (`response_format: {"type": "text"}`,
  `tool_choice: "none"`, ...): silently ignoring it would change the output
  the client asked for. Fields that never change the output (`user`,
  `store`, `metadata`, `parallel_tool_calls`, ...) are accepted; fields
  nobody declared are ignored (clients add new ones all the time).
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Callable, Literal, Optional, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, WrapValidator, field_validator
from pydantic_core import PydanticCustomError

from paged.core.sampling_params import MAX_LOGIT_BIAS, MAX_LOGPROBS, SEED_MAX, SEED_MIN


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


_STRUCTURED = "structured output is not supported yet"
_TOOLS = "tools are not supported yet"


class _Request(BaseModel):
    # strict: no coercion of "10" / "yes" / true; allow_inf_nan: finite numbers only
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class StreamOptions(_Request):
    include_usage: bool = False


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[dict[str, Any]] = None


Stop = Annotated[Optional[Union[str, list[str]]], expect("a string or a list of strings"),
                 AfterValidator(_non_empty)]
LogitBias = dict[str, Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]]


class SamplingFields(_Request):
    """Sampling fields shared by completions and chat completions."""

    model: Optional[str] = None
    n: int = Field(1, ge=1, le=128)
    temperature: Optional[float] = Field(None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)
    stop: Stop = None
    seed: Optional[int] = Field(None, ge=SEED_MIN, le=SEED_MAX)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: Optional[LogitBias] = Field(None, description="token id (as a string) -> bias in [-100, 100]")
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    response_format: Annotated[Optional[ResponseFormat], only_if(
        lambda v: v is None or v.type == "text", f'null or {{"type": "text"}} ({_STRUCTURED})')] = None
    # vLLM extensions
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    top_k: Optional[int] = Field(None, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    stop_token_ids: Optional[list[Annotated[int, Field(ge=0)]]] = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    guided_json: Annotated[Optional[Any], only_if(_absent, f"null ({_STRUCTURED})")] = None
    guided_regex: Annotated[Optional[Any], only_if(_absent, f"null ({_STRUCTURED})")] = None
    guided_choice: Annotated[Optional[Any], only_if(_absent, f"null ({_STRUCTURED})")] = None
    guided_grammar: Annotated[Optional[Any], only_if(_absent, f"null ({_STRUCTURED})")] = None
    structured_outputs: Annotated[Optional[Any], only_if(_absent, f"null ({_STRUCTURED})")] = None
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


PromptType = Annotated[Union[str, list[str], list[int], list[list[int]]],
                       expect("a string, a list of strings, a list of token ids or a list of token-id lists")]


class CompletionRequest(SamplingFields):
    prompt: PromptType
    max_tokens: Optional[int] = Field(16, ge=1)
    echo: bool = False
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
    suffix: Annotated[Optional[str], only_if(_absent_or_empty, "null (suffix is not supported)")] = None
    best_of: Optional[int] = Field(None, ge=1, description="only null or equal to n (one sample per choice)")

    @field_validator("prompt")
    @classmethod
    def _prompt_not_empty(cls, v):
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


class ChatMessage(_Request):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Annotated[Optional[Union[str, list[TextPart]]],
                       expect('a string or a list of {"type": "text", "text": ...} parts '
                              "(only text is supported)")] = None
    name: Optional[str] = None
    tool_call_id: Optional[str] = None
    tool_calls: Annotated[Optional[list[Any]], only_if(_absent_or_empty, f"no tool_calls ({_TOOLS})")] = None
    function_call: Annotated[Optional[Any], only_if(_absent, f"null ({_TOOLS})")] = None

    def text(self) -> str:
        """Content as plain text (OpenAI's list-of-parts form joined)."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part.text for part in self.content)

    def for_template(self) -> dict[str, str]:
        msg = {"role": self.role, "content": self.text()}
        return {**msg, "name": self.name} if self.name is not None else msg


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: Optional[int] = Field(None, ge=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    tools: Annotated[Optional[list[dict[str, Any]]], only_if(_absent_or_empty, f"no tools ({_TOOLS})")] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
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
    def _tool_choice_no_op(cls, choice, info):
        if choice is None or choice == "none" or (choice == "auto" and not info.data.get("tools")):
            return choice
        raise _expected(f'null, "none", or "auto" without tools ({_TOOLS})')

    def effective_max_tokens(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(_Request):
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Request):
    model: Optional[str] = None
    tokens: list[Annotated[int, Field(ge=0)]]


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
