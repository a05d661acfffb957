"""Reads Hermes-style tool calls out of a chat output, whole or as it grows.

    parsed = parse_tool_calls(text, names={"get_weather"}, final=True)
    parsed.content     # the text outside the calls ("" when none)
    parsed.calls       # [ParsedCall(name, arguments, complete)]

The parse is a function of the text alone and never takes back what it
said about a shorter text: content only grows at its end, a call once seen
stays a call, its arguments only grow. So a stream can send the difference
between two parses as deltas (ToolCallStream), and those deltas add up to
the parse of the final text, which is what the non-streamed response shows.
To keep that promise, text that may still turn out to be part of a call (a
trailing "<tool_c", or a "<tool_call>" block whose head has not been read)
is held back until it is decided, and whitespace next to a call, or at the
end, is dropped (it is released once more text follows it).

A block is a call when it reads `{"name": "<a known tool>", "arguments": {`;
from that "{" on its arguments are the raw JSON text up to the matching "}"
(exactly what the model wrote, so the streamed pieces and the final string
agree). A block that turns out otherwise is kept as content, verbatim.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass, field
from typing import Optional

from paged.core.entrypoints.tools import CLOSE, OPEN

_WS = re.compile(r"\s*")
_NAME = re.compile(r'[^"\\]*')
# the head of a call, as literal pieces with optional whitespace between them
_HEAD = ("{", '"name"', ":", '"', None, '"', ",", '"arguments"', ":")


@dataclass
class ParsedCall:
    name: str
    arguments: str  # JSON text, possibly unfinished
    complete: bool


@dataclass
class ParsedOutput:
    content: str
    calls: list[ParsedCall] = field(default_factory=list)


def parse_tool_calls(text: str, names: Optional[set[str]], final: bool) -> ParsedOutput:
    """`names`: the tools' names (None: any name); `final`: nothing more will
    be appended (held-back text is released)."""
    segments: list[str] = []
    calls: list[ParsedCall] = []
    seg_start = search = 0
    while True:
        i = text.find(OPEN, search)
        if i < 0:
            tail = text[seg_start:]
            segments.append(tail if final else tail[:len(tail) - _partial_tag(tail)])
            break
        closed_at = text.find(CLOSE, i + len(OPEN))
        body = text[i + len(OPEN):closed_at if closed_at >= 0 else len(text)]
        verdict = _read_call(body, names, done=final or closed_at >= 0)
        if verdict is None:  # undecided: hold back from the tag on
            segments.append(text[seg_start:i])
            break
        if verdict is False:  # not a call: the block stays in the content
            search = i + len(OPEN)
            continue
        segments.append(text[seg_start:i])
        calls.append(verdict)
        if closed_at < 0:
            break
        seg_start = search = closed_at + len(CLOSE)
    return ParsedOutput(_join(segments), calls)


def _join(segments: list[str]) -> str:
    """The content: segments between calls, trimmed where they meet a call
    and at the ends, the non-empty ones joined by newlines."""
    return "\n".join(s.strip() for s in segments if s.strip())


def _partial_tag(tail: str) -> int:
    """How many trailing characters could be the start of OPEN."""
    for k in range(min(len(OPEN) - 1, len(tail)), 0, -1):
        if tail.endswith(OPEN[:k]):
            return k
    return 0


def _read_call(body: str, names: Optional[set[str]], done: bool):
    """A ParsedCall, False (not a call) or None (undecided yet)."""
    pos, name = 0, None
    for piece in _HEAD:
        if piece is None:  # the name, up to its closing quote
            name = _NAME.match(body, pos).group()
            pos += len(name)
            continue
        if name is None or piece != '"':  # whitespace may precede any piece but the name's closing quote
            pos = _WS.match(body, pos).end()
        got = body[pos:pos + len(piece)]
        if got != piece:
            return None if not done and piece.startswith(got) and pos + len(got) == len(body) else False
        pos += len(piece)
        if piece == '"' and name is not None and names is not None and name not in names:
            return False
    pos = _WS.match(body, pos).end()
    if pos == len(body):
        return False if done else None
    if body[pos] != "{":
        return False
    end = _json_end(body, pos)
    return ParsedCall(name, body[pos:end if end is not None else len(body)], end is not None)


def _json_end(text: str, start: int) -> Optional[int]:
    """The index after the JSON object or array opening at `start`, or None
    when the text ends first."""
    depth, in_string, escaped = 0, False, False
    for j in range(start, len(text)):
        c = text[j]
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return j + 1
    return None


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCallStream:
    """The OpenAI stream deltas of one choice, from its growing text."""

    def __init__(self, names: Optional[set[str]]):
        self.names = names
        self.content_sent = 0
        self.args_sent: list[int] = []  # per call: characters of arguments sent

    @property
    def num_calls(self) -> int:
        return len(self.args_sent)

    def update(self, text: str, final: bool) -> tuple[str, list[dict]]:
        """(content delta, tool_call deltas) since the last update."""
        parsed = parse_tool_calls(text, self.names, final)
        content = parsed.content[self.content_sent:]
        self.content_sent = len(parsed.content)
        deltas = []
        for i, call in enumerate(parsed.calls):
            if i == len(self.args_sent):
                deltas.append({"index": i, "id": call_id(), "type": "function",
                               "function": {"name": call.name, "arguments": call.arguments}})
                self.args_sent.append(len(call.arguments))
            elif len(call.arguments) > self.args_sent[i]:
                deltas.append({"index": i, "function": {"arguments": call.arguments[self.args_sent[i]:]}})
                self.args_sent[i] = len(call.arguments)
        return content, deltas
