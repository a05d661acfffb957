"""SamplingParams: how one request turns logits into tokens, and when it stops.

Validated once at construction; an invalid value raises ValueError naming
the field, so the server and CLI can report it without a traceback.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

#: cap on logprobs / prompt_logprobs per token (keeps outputs small)
MAX_LOGPROBS = 20


def _bad(name: str, value, rule: str) -> ValueError:
    return ValueError(f"{name} must be {rule}, got {value!r}")


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: Optional[int] = None
    max_tokens: Optional[int] = 16  # None: up to the model's context length
    min_tokens: int = 0
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: Optional[int] = None  # top-k logprobs per generated token (+ the chosen one)
    prompt_logprobs: Optional[int] = None  # same, for each prompt token
    skip_special_tokens: bool = True
    stop_strings: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._validate()
        if self.stop is None:
            self.stop_strings = []
        elif isinstance(self.stop, str):
            self.stop_strings = [self.stop]
        else:
            self.stop_strings = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0

    def _validate(self) -> None:
        def is_int(x):
            return isinstance(x, int) and not isinstance(x, bool)

        def is_num(x):
            return isinstance(x, (int, float)) and not isinstance(x, bool)

        if not is_int(self.n) or self.n < 1:
            raise _bad("n", self.n, "an integer >= 1")
        if not is_num(self.temperature) or not 0.0 <= self.temperature or self.temperature != self.temperature:
            raise _bad("temperature", self.temperature, "a number >= 0")
        if not is_num(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise _bad("top_p", self.top_p, "in (0, 1]")
        if not is_int(self.top_k) or (self.top_k < 0 and self.top_k != -1):
            raise _bad("top_k", self.top_k, "an integer >= 0 (0 or -1 disables it)")
        if not is_num(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise _bad("min_p", self.min_p, "in [0, 1]")
        if not is_num(self.repetition_penalty) or not self.repetition_penalty > 0.0:
            raise _bad("repetition_penalty", self.repetition_penalty, "a number > 0")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not is_num(v) or not -2.0 <= v <= 2.0:
                raise _bad(name, v, "in [-2, 2]")
        if self.seed is not None and not is_int(self.seed):
            raise _bad("seed", self.seed, "an integer or None")
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 1):
            raise _bad("max_tokens", self.max_tokens, "an integer >= 1 or None")
        if not is_int(self.min_tokens) or self.min_tokens < 0:
            raise _bad("min_tokens", self.min_tokens, "an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise _bad("min_tokens", self.min_tokens, f"<= max_tokens ({self.max_tokens})")
        if self.stop is not None:
            stops = [self.stop] if isinstance(self.stop, str) else self.stop
            if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) and s for s in stops):
                raise _bad("stop", self.stop, "a non-empty string or a list of non-empty strings")
        if self.stop_token_ids is not None:
            if not isinstance(self.stop_token_ids, (list, tuple)) or not all(
                    is_int(t) and t >= 0 for t in self.stop_token_ids):
                raise _bad("stop_token_ids", self.stop_token_ids, "a list of non-negative integers")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not is_int(v) or not 0 <= v <= MAX_LOGPROBS):
                raise _bad(name, v, f"an integer in [0, {MAX_LOGPROBS}] or None")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise _bad(name, getattr(self, name), "a bool")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate_for_vocab(self, vocab_size: int) -> None:
        """Checks that need the model: token ids inside the vocabulary."""
        for t in self.stop_token_ids:
            if t >= vocab_size:
                raise _bad("stop_token_ids", self.stop_token_ids, f"ids < vocab size {vocab_size}")
