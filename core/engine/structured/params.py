"""StructuredOutputsParams: the constraint one request's output must satisfy.

vLLM's request object, same field names, so code written for vLLM's
`SamplingParams(structured_outputs=StructuredOutputsParams(json=...))` runs
here unchanged. Exactly one constraint per request:

    json         a JSON schema (dict, or its JSON text)
    regex        a regular expression (Rust regex syntax: no look-around)
    choice       a list of strings; the output is one of them
    grammar      a Lark grammar (llguidance's dialect) or a GBNF grammar
    json_object  True: any JSON object (OpenAI's response_format json_object)

This module only checks shapes; whether a schema, regex or grammar compiles
is decided by the compiler (core/engine/structured/compiler.py), once per distinct
constraint. Pure Python: no llguidance import here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional, Union

from paged.core.argcheck import expected as _expected

KINDS = ("json", "regex", "choice", "grammar", "json_object")
#: how generated JSON is laid out: no free whitespace, ", " and ": " as json.dumps
#: writes them (a model allowed free whitespace can spend all its tokens on newlines)
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: Optional[Union[str, dict[str, Any]]] = None
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise _expected("structured_outputs", f"exactly one of {', '.join(KINDS)}",
                            ", ".join(given) if given else "none")
        if isinstance(self.json, str):
            object.__setattr__(self, "json", _schema_from_text(self.json))
        self._check()

    def _check(self) -> None:
        if self.json is not None and not isinstance(self.json, dict):
            raise _expected("structured_outputs.json", "a JSON schema object", self.json)
        if self.regex is not None and not (isinstance(self.regex, str) and self.regex):
            raise _expected("structured_outputs.regex", "a non-empty string", self.regex)
        if self.grammar is not None and not (isinstance(self.grammar, str) and self.grammar.strip()):
            raise _expected("structured_outputs.grammar", "a non-empty string", self.grammar)
        if self.choice is not None and not (isinstance(self.choice, (list, tuple)) and self.choice
                                            and all(isinstance(c, str) for c in self.choice)):
            raise _expected("structured_outputs.choice", "a non-empty list of strings", self.choice)
        if self.json_object is not None and self.json_object is not True:
            raise _expected("structured_outputs.json_object", "true or None", self.json_object)

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def value(self) -> Any:
        return getattr(self, self.kind)

    def key(self) -> tuple[str, str]:
        """The cache key: equal keys compile to the same grammar. Schema key
        order is kept (it decides the order properties are written in).
        Computed once (a large schema's JSON text takes milliseconds)."""
        key = self.__dict__.get("_key")
        if key is None:
            value = self.value
            key = self.kind, value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
            object.__setattr__(self, "_key", key)  # frozen: not a field, so equality is unchanged
        return key

    def describe(self) -> str:
        """Short, for logs and errors: 'json schema', 'regex', ..."""
        return {"json": "JSON schema", "json_object": "JSON object", "choice": "choice list"}.get(
            self.kind, self.kind)


def _schema_from_text(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError:
        raise _expected("structured_outputs.json", "a JSON schema (valid JSON text)", text) from None
    if not isinstance(value, dict):
        raise _expected("structured_outputs.json", "a JSON schema object", value)
    return value
