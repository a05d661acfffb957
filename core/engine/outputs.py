"""What the engine hands back per step: cumulative text / token ids per sample.

The server derives stream deltas from these; the offline API returns the
final ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

#: one generated (or prompt) position: {token_id: logprob} for the top-k and the chosen token
TokenLogprobs = dict[int, float]


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    finished_time: Optional[float] = None
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_preemptions: int = 0

    @property
    def ttft(self) -> Optional[float]:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: Optional[str] = None  # "stop" | "length" | "abort" | None while running
    stop_reason: Union[str, int, None] = None  # the stop string or stop token id that matched
    logprobs: Optional[list[TokenLogprobs]] = None
    cumulative_logprob: Optional[float] = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: Optional[RequestMetrics] = None
    prompt_logprobs: Optional[list[Optional[TokenLogprobs]]] = field(default=None)
