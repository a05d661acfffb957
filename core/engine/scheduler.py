"""Continuous-batching scheduler.

Each step fills a token budget (``max_num_batched_tokens``) with, in order:

1. one token for every running sequence that is decoding (oldest first);
   with speculative decoding (core/engine/spec_decode.py) a decoding sequence with
   n-gram drafts gets 1 + len(drafts) tokens instead (``verifies``), drafts
   taking only budget that every decoding sequence's one token leaves,
2. the next prompt chunk of running sequences still in prefill,
3. new sequences from the waiting queue (FCFS, prefix-cache lookup at
   admission), each taking a chunk of what budget is left.

So a long prompt is split into chunks and never stalls running decodes:
while any sequence decodes, prompt chunks (2 and 3) share at most what the
``prefill_budget`` (core/engine/prefill_budget.py: a step-time target, learned
costs) allows for the step's decode rows, or without one a fixed
``max_prefill_tokens_with_decodes``, so a decode's inter-token latency is a
decode step plus that much prefill, not a whole budget's worth
(docs/engine.md, "Prefill while decoding"). A step with no decodes uses
the whole budget for prompts.
When the KV cache runs out of blocks for a running sequence, the newest
running sequence is preempted by recompute: its blocks are freed and it goes
back to the front of the waiting queue with its generated tokens kept, to be
recomputed as part of its prompt. Waiting sequences never hold blocks.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

from paged.core.engine.request import Request, Sequence, SeqStatus
from paged.core.engine.spec_decode import speculates


def prompt_chunk(seq: Sequence, start: int, n: int) -> int:
    """n, cut so that a chunk never spans the end of the original prompt.
    After a preemption the generated tokens are recomputed as part of the
    prefill; ending the prompt's chunk there lets their rows come right after
    the decodes (the scheduler sorts them first) and keep the arithmetic of a
    row that generates a token (AttentionMetadata.first_prompt_row), so a
    preempted sequence continues bitwise as if it never was."""
    if start < seq.num_prompt_tokens < start + n:
        return seq.num_prompt_tokens - start
    return n


class WaitingQueueFull(RuntimeError):
    """The waiting queue is at max_waiting; the server answers 503."""


@dataclass
class ScheduledSeq:
    seq: Sequence
    start: int  # first position computed this step (= num_computed_tokens before the step)
    num_new_tokens: int
    # speculative decoding: draft tokens computed after the last known token
    # (num_new_tokens = 1 + len(draft)); each of their rows samples too
    draft: list[int] = field(default_factory=list)

    def new_token_ids(self) -> list[int]:
        """The input tokens of this step's rows."""
        known = self.seq.token_ids[self.start:self.start + self.num_new_tokens - len(self.draft)]
        return known + self.draft if self.draft else known

    @property
    def in_prompt(self) -> bool:
        """Whether this step's rows are tokens of the original prompt (a
        prompt chunk), not rows that generate a token: decodes, verifies and
        generated tokens recomputed after a preemption (prompt_chunk)."""
        return self.start < self.seq.num_prompt_tokens

    @property
    def samples(self) -> bool:
        """Whether this step computes the sequence's last known token, so its
        logits give the next token (a prompt chunk that does not finish the
        prompt does not sample)."""
        return self.start + self.num_new_tokens - len(self.draft) == len(self.seq.token_ids)


@dataclass
class SchedulerOutput:
    decodes: list[ScheduledSeq] = field(default_factory=list)
    verifies: list[ScheduledSeq] = field(default_factory=list)  # decodes with drafts (several rows)
    prefills: list[ScheduledSeq] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)  # CoW (src, dst) before the forward
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def scheduled(self) -> list[ScheduledSeq]:
        """Decodes first, then verifies and prefills (several query rows
        each): the AttentionMetadata order."""
        return self.decodes + self.verifies + self.prefills

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + sum(s.num_new_tokens for s in self.verifies + self.prefills)

    @property
    def empty(self) -> bool:
        return not self.decodes and not self.verifies and not self.prefills


class Scheduler:
    def __init__(self, kv_cache_manager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_waiting: Optional[int] = None, enable_prefix_caching: bool = True,
                 max_prefill_tokens_with_decodes: Optional[int] = None, proposer=None,
                 prefill_budget=None):
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
        if max_prefill_tokens_with_decodes is not None and max_prefill_tokens_with_decodes < 1:
            raise ValueError("max_prefill_tokens_with_decodes: expected an integer >= 1 or None, "
                             f"got {max_prefill_tokens_with_decodes}")
        self.kv = kv_cache_manager
        self.proposer = proposer  # spec_decode.NgramProposer, or None: one token per decode
        self.max_prefill_tokens_with_decodes = max_prefill_tokens_with_decodes
        # prefill_budget.PrefillBudget, or None: the fixed cap above (the budget holds its own cap)
        self.prefill_budget = prefill_budget
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_waiting = max_waiting
        self.enable_prefix_caching = enable_prefix_caching
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order: the newest is last
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    # -- queue management -----------------------------------------------------
    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request_id {req.request_id!r} is already in use")
        if self.max_waiting is not None and len(self.waiting) >= self.max_waiting:
            raise WaitingQueueFull(f"the waiting queue is full ({self.max_waiting} requests)")
        self.requests[req.request_id] = req
        self.waiting.extend(req.seqs)

    def abort_request(self, request_id: str) -> Optional[Request]:
        """Finishes every sequence of the request with 'abort' and frees its
        blocks. Returns the request, or None when unknown / already done."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        for seq in req.seqs:
            if seq.status is SeqStatus.RUNNING:
                self.running.remove(seq)
                self.kv.free(seq.seq_id)
            elif seq.status is SeqStatus.WAITING:
                self.waiting.remove(seq)
            if not seq.finished:
                seq.finish("abort")
        return req

    def finish_seq(self, seq: Sequence) -> None:
        """Called once a sequence has finished (stop / length): frees its blocks."""
        if seq in self.running:
            self.running.remove(seq)
            self.kv.free(seq.seq_id)
        if seq.group.finished:
            self.requests.pop(seq.group.request_id, None)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """n > 1: the child shares all of the parent's blocks (copy-on-write)."""
        self.kv.fork(parent.seq_id, child.seq_id)
        child.status = SeqStatus.RUNNING
        self.running.insert(self.running.index(parent) + 1, child)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step ---------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        scheduled: set[str] = set()

        # 1. decodes, oldest first
        spare = budget - sum(not s.in_prefill for s in self.running)  # what drafts may take
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.in_prefill:
                i += 1
                continue
            draft = self._propose(seq, min(spare, budget - 1))
            if draft and self._allocate_now(seq, 1 + len(draft), out):
                out.verifies.append(ScheduledSeq(seq, seq.num_computed_tokens, 1 + len(draft), draft))
                scheduled.add(seq.seq_id)
                budget -= 1 + len(draft)
                spare -= len(draft)
                i += 1
            elif self._allocate_running(seq, 1, out, scheduled):
                out.decodes.append(ScheduledSeq(seq, seq.num_computed_tokens, 1))
                scheduled.add(seq.seq_id)
                budget -= 1
                i += 1
            # else: seq itself was preempted and removed; i now points at the next one

        # prompt chunks below share what is left, capped while decodes run
        cap = self._prefill_cap(out) if out.decodes or out.verifies else None
        if cap is not None:
            budget = min(budget, cap)

        # 2. prompt chunks of running sequences still in prefill
        for seq in list(self.running):
            if budget <= 0:
                break
            if not seq.in_prefill or seq.seq_id in scheduled or seq.status is not SeqStatus.RUNNING:
                continue
            n = prompt_chunk(seq, seq.num_computed_tokens, min(seq.prefill_target - seq.num_computed_tokens, budget))
            if self._allocate_running(seq, n, out, scheduled):
                out.prefills.append(ScheduledSeq(seq, seq.num_computed_tokens, n))
                scheduled.add(seq.seq_id)
                budget -= n

        # 3. admissions (not while blocks are short enough to preempt)
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not out.preempted:
            seq = self.waiting[0]
            if not self._admit(seq, budget, out):
                break
            self.waiting.popleft()
            scheduled.add(seq.seq_id)
            budget -= out.prefills[-1].num_new_tokens
        # recomputed generated tokens first: rows that produced a token keep that role (see prompt_chunk)
        out.prefills.sort(key=lambda e: e.in_prompt)
        return out

    def advance(self, out: SchedulerOutput) -> None:
        """After the forward: the scheduled tokens are now in the KV cache."""
        for s in out.scheduled:
            s.seq.num_computed_tokens += s.num_new_tokens

    def rollback(self, seq: Sequence, num_rejected: int) -> None:
        """After a verified step: the last ``num_rejected`` drafts' K/V is
        not the sequence's; their slots go back (the next step recomputes
        from the first rejected position)."""
        if num_rejected:
            seq.num_computed_tokens -= num_rejected
            self.kv.truncate(seq.seq_id, seq.num_computed_tokens)

    # -- helpers -----------------------------------------------------------------
    def _prefill_cap(self, out: SchedulerOutput) -> Optional[int]:
        """Prompt tokens a step with these decodes / verifies may carry (None: no cap)."""
        if self.prefill_budget is None:
            return self.max_prefill_tokens_with_decodes
        return self.prefill_budget.tokens(out.num_tokens)

    def _admit(self, seq: Sequence, budget: int, out: SchedulerOutput) -> bool:
        req = seq.group
        hit = 0
        use_cache = self.enable_prefix_caching and req.params.prompt_logprobs is None
        if use_cache:
            hit = self.kv.get_computed_tokens(seq.seq_id, seq.token_ids)
        n = prompt_chunk(seq, hit, min(seq.prefill_target - hit, budget))
        copies = self.kv.allocate_slots(seq.seq_id, seq.token_ids, hit, n)
        if copies is None:
            self.kv.free(seq.seq_id)  # give back the prefix-hit references taken above
            return False
        out.copies.extend(copies)
        seq.num_computed_tokens = hit
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)
        out.prefills.append(ScheduledSeq(seq, hit, n))
        if req.metrics.first_scheduled_time is None:
            req.metrics.first_scheduled_time = time.time()
            req.metrics.num_cached_tokens = hit
        return True

    def _propose(self, seq: Sequence, room: int) -> list[int]:
        """Draft tokens for a decoding sequence (none without a proposer, when
        its sampling rules out speculation, or past its max_tokens)."""
        if self.proposer is None or room <= 0 or not speculates(seq):
            return []
        left = seq.group.max_tokens - seq.num_output_tokens - 1  # the verified token comes on top
        return self.proposer.propose(seq.token_ids, min(room, left))

    def _allocate_now(self, seq: Sequence, n: int, out: SchedulerOutput) -> bool:
        """Room for n more tokens without preempting anyone."""
        copies = self.kv.allocate_slots(seq.seq_id, seq.token_ids, seq.num_computed_tokens, n)
        if copies is None:
            return False
        out.copies.extend(copies)
        return True

    def _allocate_running(self, seq: Sequence, n: int, out: SchedulerOutput, scheduled: set[str]) -> bool:
        """Room for n more tokens of a running sequence, preempting the newest
        unscheduled running sequences while blocks are short. False when seq
        itself had to be preempted."""
        while True:
            copies = self.kv.allocate_slots(seq.seq_id, seq.token_ids, seq.num_computed_tokens, n)
            if copies is not None:
                out.copies.extend(copies)
                return True
            victim = next(s for s in reversed(self.running) if s.seq_id not in scheduled)
            self._preempt(victim, out)
            if victim is seq:
                return False

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.kv.free(seq.seq_id)
        seq.reset_for_recompute()
        self.waiting.appendleft(seq)
        seq.group.metrics.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(seq)

    def stats(self) -> dict:
        return {
            "num_running": len(self.running),
            "num_waiting": len(self.waiting),
            "num_preemptions": self.num_preemptions,
        }
