"""SamplingParams: how one request turns logits into tokens, and when it stops.

Validated once at construction; an invalid value raises ValueError in the
project's one error vocabulary, `name: expected X, got Y`, so the server and
CLI can report it without a traceback. Everything the sampler later relies
on (finite numbers, a seed torch accepts, bias entries) is checked here: a
value that got past this point would fail inside an engine step instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Union

from paged.core.argcheck import expected
from paged.core.engine.structured.params import StructuredOutputsParams

#: cap on logprobs / prompt_logprobs per token (keeps outputs small)
MAX_LOGPROBS = 20
#: torch.Generator.manual_seed takes any 64-bit value, signed or not
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
#: OpenAI's range for a logit_bias value
MAX_LOGIT_BIAS = 100.0


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _in(x, lo: float, hi: float) -> bool:
    return _is_finite(x) and lo <= x <= hi


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
    logit_bias: Optional[dict[int, float]] = None  # token id -> added to its logit (greedy too)
    # the output must match a JSON schema, regex, choice or grammar (core/engine/structured/)
    structured_outputs: Optional[StructuredOutputsParams] = None
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
        self.logit_bias = {int(t): float(b) for t, b in (self.logit_bias or {}).items()}
        if self.top_k == -1:
            self.top_k = 0

    def _validate(self) -> None:
        self._validate_sampling()
        self._validate_lengths()
        self._validate_stops()
        self._validate_outputs()

    def _validate_sampling(self) -> None:
        if not _in(self.temperature, 0.0, math.inf):
            raise expected("temperature", "a finite number >= 0", self.temperature)
        if not _in(self.top_p, 0.0, 1.0) or self.top_p == 0.0:
            raise expected("top_p", "a number in (0, 1]", self.top_p)
        if not _is_int(self.top_k) or (self.top_k < 0 and self.top_k != -1):
            raise expected("top_k", "an integer >= 0 (0 or -1 disables it)", self.top_k)
        if not _in(self.min_p, 0.0, 1.0):
            raise expected("min_p", "a number in [0, 1]", self.min_p)
        if not _in(self.repetition_penalty, 0.0, math.inf) or self.repetition_penalty == 0.0:
            raise expected("repetition_penalty", "a finite number > 0", self.repetition_penalty)
        for name in ("presence_penalty", "frequency_penalty"):
            if not _in(getattr(self, name), -2.0, 2.0):
                raise expected(name, "a number in [-2, 2]", getattr(self, name))
        if self.seed is not None and not (_is_int(self.seed) and SEED_MIN <= self.seed <= SEED_MAX):
            raise expected("seed", f"an integer in [{SEED_MIN}, {SEED_MAX}] or None", self.seed)
        if self.logit_bias is not None and not _valid_bias(self.logit_bias):
            raise expected("logit_bias", f"a dict of token id -> number in [-{MAX_LOGIT_BIAS:g}, "
                                         f"{MAX_LOGIT_BIAS:g}]", self.logit_bias)

    def _validate_lengths(self) -> None:
        if not _is_int(self.n) or self.n < 1:
            raise expected("n", "an integer >= 1", self.n)
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise expected("max_tokens", "an integer >= 1 or None", self.max_tokens)
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise expected("min_tokens", "an integer >= 0", self.min_tokens)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise expected("min_tokens", f"at most max_tokens ({self.max_tokens})", self.min_tokens)

    def _validate_stops(self) -> None:
        if self.stop is not None:
            stops = [self.stop] if isinstance(self.stop, str) else self.stop
            if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) and s for s in stops):
                raise expected("stop", "a non-empty string or a list of non-empty strings", self.stop)
        if self.stop_token_ids is not None:
            if not isinstance(self.stop_token_ids, (list, tuple)) or not all(
                    _is_int(t) and t >= 0 for t in self.stop_token_ids):
                raise expected("stop_token_ids", "a list of non-negative integers", self.stop_token_ids)

    def _validate_outputs(self) -> None:
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or not 0 <= v <= MAX_LOGPROBS):
                raise expected(name, f"an integer in [0, {MAX_LOGPROBS}] or None", v)
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise expected(name, "a bool", getattr(self, name))
        so = self.structured_outputs
        if so is not None and not isinstance(so, StructuredOutputsParams):
            raise expected("structured_outputs", "a StructuredOutputsParams or None", so)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate_for_vocab(self, vocab_size: int) -> None:
        """Checks that need the model: token ids inside the vocabulary."""
        for name, ids in (("stop_token_ids", self.stop_token_ids), ("logit_bias", list(self.logit_bias))):
            bad = next((t for t in ids if t >= vocab_size), None)
            if bad is not None:
                raise expected(name, f"token ids < the vocabulary size {vocab_size}", bad)


def _valid_bias(bias) -> bool:
    return isinstance(bias, dict) and all(
        _is_int(t) and t >= 0 and _in(b, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS) for t, b in bias.items())
