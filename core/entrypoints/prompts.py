"""The prompt forms of the offline API (``LLM.generate`` / ``LLM.chat``),
vLLM's included, checked into what the engine takes.

    prompts_of("Hi")                                   -> ["Hi"]
    prompts_of([1, 2, 3])                              -> [[1, 2, 3]]     (one tokenized prompt)
    prompts_of(["Hi", {"prompt": "Yo"}, {"prompt_token_ids": [1, 2]}, [4, 5]])
                                                       -> ["Hi", "Yo", [1, 2], [4, 5]]
    conversations_of([{"role": "user", "content": "Hi"}])         -> one conversation
    conversations_of([[...], [...]])                              -> several

A prompt is a string, a list of token ids, vLLM's TextPrompt
(``{"prompt": str}``) or TokensPrompt (``{"prompt_token_ids": [int, ...]}``,
whose optional ``"prompt"`` text is informational); ``prompts`` is one prompt
or a list of them, mixed freely. Anything else is a ValueError in the
project's shape, naming where: ``prompts[2]["prompt_token_ids"][1]: expected
a token id in [0, 49152), got 70000``. Keys paged cannot honour
(``multi_modal_data``, ``prompt_embeds``, ...) are refused, never ignored.
"""

from __future__ import annotations

import numbers
from typing import Any, Optional, Union

from paged.core.argcheck import message, short_repr

Prompt = Union[str, list[int]]

#: what one prompt may be, for messages
PROMPT_FORMS = 'a string, a list of token ids, {"prompt": str} or {"prompt_token_ids": [int, ...]}'
#: keys of vLLM's prompt dicts that paged does not take, and why
_REFUSED = {
    "multi_modal_data": "paged serves text-only models",
    "mm_processor_kwargs": "paged serves text-only models",
    "multi_modal_uuids": "paged serves text-only models",
    "prompt_embeds": "prompt embeddings are not supported: give text or token ids",
    "token_type_ids": "for cross-encoder models, which paged does not serve",
    "cache_salt": "not supported (one process, one prefix cache)",
}
#: message roles the chat templates know
ROLES = ("system", "user", "assistant", "tool", "developer")


def _fail(name: str, want: str, got) -> ValueError:
    return ValueError(message(name, want, got))


def _describe(value: Any) -> str:
    """`int 5`, `float 1.5`, `None`, `True`: the type and a short repr."""
    if value is None or isinstance(value, bool):
        return repr(value)
    return f"{type(value).__name__} {short_repr(value)}"


def _is_id(x: Any) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _token_ids(value: Any, name: str, vocab_size: Optional[int]) -> list[int]:
    if not isinstance(value, (list, tuple)) or not value:
        got = "an empty list" if isinstance(value, (list, tuple)) else _describe(value)
        raise _fail(name, "a non-empty list of token ids", got)
    for i, t in enumerate(value):
        if not _is_id(t):
            raise _fail(f"{name}[{i}]", "a token id (an int)", _describe(t))
        if vocab_size is not None and not 0 <= int(t) < vocab_size:
            raise _fail(f"{name}[{i}]", f"a token id in [0, {vocab_size})", int(t))
    return [int(t) for t in value]


def _one(value: Any, name: str, vocab_size: Optional[int]) -> Prompt:
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)):
        return _token_ids(value, name, vocab_size)
    if isinstance(value, dict):
        return _from_dict(value, name, vocab_size)
    raise _fail(name, PROMPT_FORMS, _describe(value))


def _from_dict(d: dict, name: str, vocab_size: Optional[int]) -> Prompt:
    for key, why in _REFUSED.items():
        if key in d and d[key] is not None:
            raise _fail(f'{name}["{key}"]', f"absent ({why})", short_repr(d[key]))
    unknown = sorted(str(k) for k in d if k not in ("prompt", "prompt_token_ids") and k not in _REFUSED)
    if unknown:
        raise _fail(name, 'a dict with the keys "prompt" or "prompt_token_ids"', f"the key {unknown[0]!r}")
    if "prompt_token_ids" in d:  # a TokensPrompt; its "prompt" is the text it came from, if given
        if "prompt" in d and not isinstance(d["prompt"], str):
            raise _fail(f'{name}["prompt"]', "a string (the text of the token ids)", _describe(d["prompt"]))
        return _token_ids(d["prompt_token_ids"], f'{name}["prompt_token_ids"]', vocab_size)
    if "prompt" in d:
        if not isinstance(d["prompt"], str):
            raise _fail(f'{name}["prompt"]', "a string", _describe(d["prompt"]))
        return d["prompt"]
    raise _fail(name, 'a dict with "prompt" (text) or "prompt_token_ids"', "an empty dict" if not d else
                f"a dict without either (keys: {', '.join(sorted(map(str, d)))})")


def prompts_of(prompts: Any, vocab_size: Optional[int] = None) -> list[Prompt]:
    """One prompt or a list of them -> the list of engine prompts (text or
    token ids); token ids checked against ``vocab_size`` when given."""
    if isinstance(prompts, (str, dict)):
        return [_one(prompts, "prompts", vocab_size)]
    if not isinstance(prompts, (list, tuple)):
        raise _fail("prompts", f"{PROMPT_FORMS}, or a list of them", _describe(prompts))
    if not prompts:
        raise _fail("prompts", "at least one prompt", "an empty list")
    ids = [_is_id(p) for p in prompts]
    if all(ids):
        return [_token_ids(prompts, "prompts", vocab_size)]
    if any(ids):
        first = ids.index(False)
        raise _fail("prompts", "token ids (all ints) or a list of prompts",
                    f"ints mixed with {type(prompts[first]).__name__} at [{first}]")
    return [_one(p, f"prompts[{i}]", vocab_size) for i, p in enumerate(prompts)]


def _content(value: Any, name: str) -> str:
    """A message's content: a string, None, or OpenAI's list of text parts."""
    if value is None or isinstance(value, str):
        return value or ""
    if not isinstance(value, (list, tuple)):
        raise _fail(name, 'a string or a list of {"type": "text", "text": ...} parts', _describe(value))
    texts = []
    for i, part in enumerate(value):
        where = f"{name}[{i}]"
        if not isinstance(part, dict):
            raise _fail(where, '{"type": "text", "text": ...}', _describe(part))
        if part.get("type") != "text":
            raise _fail(f'{where}["type"]', '"text" (paged serves text-only models)', short_repr(part.get("type")))
        if not isinstance(part.get("text"), str):
            raise _fail(f'{where}["text"]', "a string", _describe(part.get("text")))
        texts.append(part["text"])
    return "".join(texts)


def _message(m: Any, name: str) -> dict:
    if not isinstance(m, dict):
        raise _fail(name, 'a message {"role": ..., "content": ...}', _describe(m))
    if m.get("role") not in ROLES:
        raise _fail(f'{name}["role"]', "one of " + ", ".join(ROLES), short_repr(m.get("role")))
    out = dict(m)
    out["content"] = _content(m.get("content"), f'{name}["content"]')
    return out


def conversations_of(messages: Any) -> list[list[dict]]:
    """One conversation (a list of messages) or a list of them -> a list of
    conversations, each message checked (role, text content; OpenAI's text
    parts joined)."""
    if not isinstance(messages, (list, tuple)) or not messages:
        got = "an empty list" if isinstance(messages, (list, tuple)) else _describe(messages)
        raise _fail("messages", 'a list of {"role", "content"} messages, or a list of such lists', got)
    if isinstance(messages[0], dict):
        return [[_message(m, f"messages[{i}]") for i, m in enumerate(messages)]]
    convs = []
    for c, conv in enumerate(messages):
        if not isinstance(conv, (list, tuple)) or not conv:
            got = "an empty list" if isinstance(conv, (list, tuple)) else _describe(conv)
            raise _fail(f"messages[{c}]", 'a conversation: a non-empty list of {"role", "content"} messages', got)
        convs.append([_message(m, f"messages[{c}][{i}]") for i, m in enumerate(conv)])
    return convs
