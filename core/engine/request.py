"""Requests and their sequences (one per sample when n > 1).

The scheduler and the model runner work on ``Sequence`` objects; a
``Request`` groups the n samples of one user request. A sequence's
``token_ids`` are prompt + generated tokens; after a preemption the whole
list is recomputed as if it were the prompt (``prefill_target``).
"""

from __future__ import annotations

import enum
import time
from typing import Optional

import torch

from paged.core.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput, TokenLogprobs
from paged.core.engine.sampling_params import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """One sample of a request: the unit the scheduler batches."""

    def __init__(self, group: "Request", index: int, token_ids: list[int], seq_id: str):
        self.group = group
        self.index = index
        self.seq_id = seq_id
        self.token_ids = token_ids
        self.num_prompt_tokens = len(group.prompt_token_ids)
        self.num_computed_tokens = 0
        self.prefill_target = len(token_ids)  # tokens to (re)compute before sampling
        self.status = SeqStatus.WAITING
        self.finish_reason: Optional[str] = None
        self.stop_reason = None
        self.logprobs: Optional[list[TokenLogprobs]] = [] if group.params.logprobs is not None else None
        self.cumulative_logprob = 0.0
        self.detok = None  # tokenizer.IncrementalDetokenizer, set by the engine
        self.text = ""  # output text, stop string already cut
        self.generator: Optional[torch.Generator] = None
        # structured output: an llguidance LLMatcher that has consumed every
        # output token (kept across preemption: recompute changes no token)
        self.matcher = None

    # -- state ---------------------------------------------------------------
    @property
    def params(self) -> SamplingParams:
        return self.group.params

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def in_prefill(self) -> bool:
        return self.num_computed_tokens < self.prefill_target

    @property
    def num_pending_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    def reset_for_recompute(self) -> None:
        """Preemption by recompute: everything computed is dropped; the
        generated tokens stay and are recomputed with the prompt."""
        self.num_computed_tokens = 0
        self.prefill_target = len(self.token_ids)
        self.status = SeqStatus.WAITING

    def finish(self, reason: str, stop_reason=None) -> None:
        self.status = SeqStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason

    # -- output ----------------------------------------------------------------
    def visible_text(self) -> str:
        """Output text safe to show now: while running, a tail that could be
        the beginning of a stop string is held back."""
        if self.finished or not self.params.stop_strings:
            return self.text
        hold = 0
        for stop in self.params.stop_strings:
            for k in range(min(len(stop) - 1, len(self.text)), hold, -1):
                if self.text.endswith(stop[:k]):
                    hold = k
                    break
        return self.text[:len(self.text) - hold] if hold else self.text

    def completion(self) -> CompletionOutput:
        return CompletionOutput(
            index=self.index,
            text=self.visible_text(),
            token_ids=list(self.output_token_ids),
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            logprobs=list(self.logprobs) if self.logprobs is not None else None,
            cumulative_logprob=self.cumulative_logprob if self.logprobs is not None else None,
        )


class Request:
    """A user request: prompt, params, and its n sequences."""

    def __init__(self, request_id: str, prompt: Optional[str], prompt_token_ids: list[int],
                 params: SamplingParams, arrival_time: Optional[float] = None):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.metrics = RequestMetrics(arrival_time=arrival_time if arrival_time is not None else time.time(),
                                      num_prompt_tokens=len(self.prompt_token_ids))
        self.prompt_logprobs: Optional[list[Optional[TokenLogprobs]]] = (
            [None] if params.prompt_logprobs is not None else None)
        # the first sequence prefills the prompt; with n > 1 it is forked
        # into the others once the prompt is computed
        self.seqs: list[Sequence] = [Sequence(self, 0, list(self.prompt_token_ids), request_id)]
        self.max_tokens = params.max_tokens  # may be clipped to the context length by the engine

    @property
    def finished(self) -> bool:
        # forks happen before the parent can finish, so this never fires early
        return all(s.finished for s in self.seqs)

    def output(self) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[s.completion() for s in self.seqs],
            finished=self.finished,
            metrics=self.metrics,
            prompt_logprobs=self.prompt_logprobs,
        )
