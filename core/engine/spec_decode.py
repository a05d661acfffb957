"""Speculative decoding with n-gram prompt lookup (docs/speculative.md).

    --speculative-config '{"method": "ngram", "num_speculative_tokens": 4,
                           "prompt_lookup_max": 4, "prompt_lookup_min": 2}'

Per decoding sequence and step, ``NgramProposer.propose`` looks for the
sequence's last n tokens (n from prompt_lookup_max down to prompt_lookup_min)
earlier in its prompt + output, and proposes the (up to K) tokens that
followed the most recent earlier occurrence. The scheduler gives such a
sequence 1 + len(drafts) query rows (the last known token, then the drafts);
one forward computes the logits of every row; ``accept`` walks them: row j's
token (greedy argmax, or a rejection-sampled one, core/engine/sampler.py) is kept
while it equals draft j + 1, and the first token that differs (or the one
after the last draft) ends the run. So a step emits 1 .. K + 1 tokens, and
the K/V rows of the rejected drafts are rolled back (Scheduler.rollback ->
KVCacheManager.truncate).

Which sequences speculate: those whose sampling does not depend on the tokens
sampled within the step -- no structured output (the grammar's mask would
have to be advanced through each draft), no repetition / presence /
frequency penalty, min_tokens already reached. The others decode one token a
step in the same batch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from paged.core.argcheck import expected

#: the keys --speculative-config takes (vLLM's names)
KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min")
#: drafts per step beyond this cost more forward rows than lookup ever saves
MAX_SPECULATIVE_TOKENS = 32
DEFAULT_LOOKUP_MAX, DEFAULT_LOOKUP_MIN = 4, 2


@dataclass(frozen=True)
class SpeculativeConfig:
    num_speculative_tokens: int
    prompt_lookup_max: int = DEFAULT_LOOKUP_MAX
    prompt_lookup_min: int = DEFAULT_LOOKUP_MIN
    method: str = "ngram"


def _positive(name: str, value, hi: int | None = None) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1 or (hi is not None and value > hi):
        raise expected(f"--speculative-config {name}", "an integer >= 1" + (f" and <= {hi}" if hi else ""), value)
    return value


def parse_speculative_config(value) -> SpeculativeConfig | None:
    """--speculative-config as JSON text, a dict, a SpeculativeConfig or None
    (off); ValueError with one line naming what is wrong."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"--speculative-config: expected a JSON object, got invalid JSON ({e})") from None
    if not isinstance(value, dict):
        raise expected("--speculative-config", "a JSON object", value)
    unknown = sorted(set(value) - set(KEYS))
    if unknown:
        raise expected("--speculative-config", "keys among " + ", ".join(KEYS), ", ".join(map(str, unknown)))
    if value.get("method") != "ngram":
        raise expected("--speculative-config method", '"ngram" (the one method built in)', value.get("method"))
    if "num_speculative_tokens" not in value:
        raise ValueError("--speculative-config: expected num_speculative_tokens, got none")
    k = _positive("num_speculative_tokens", value["num_speculative_tokens"], MAX_SPECULATIVE_TOKENS)
    hi = _positive("prompt_lookup_max", value.get("prompt_lookup_max", DEFAULT_LOOKUP_MAX))
    lo = _positive("prompt_lookup_min", value.get("prompt_lookup_min", min(DEFAULT_LOOKUP_MIN, hi)))
    if lo > hi:
        raise expected("--speculative-config prompt_lookup_min", f"<= prompt_lookup_max ({hi})", lo)
    return SpeculativeConfig(k, hi, lo)


class NgramProposer:
    """Prompt lookup: drafts are what followed the last n tokens earlier on."""

    def __init__(self, config: SpeculativeConfig):
        self.k = config.num_speculative_tokens
        self.n_max, self.n_min = config.prompt_lookup_max, config.prompt_lookup_min

    def propose(self, token_ids: list[int], limit: int) -> list[int]:
        """Up to min(K, limit) draft tokens to follow ``token_ids``, or []."""
        k = min(self.k, limit)
        length = len(token_ids)
        if k <= 0 or length <= self.n_min:
            return []
        arr = np.asarray(token_ids, dtype=np.int64)
        # candidates: earlier positions i whose token equals the last one; then
        # keep those where the n - 1 tokens before also match, n growing
        cand = np.flatnonzero(arr[:-1] == arr[-1])
        best = None
        for n in range(1, min(self.n_max, length - 1) + 1):
            if n > 1:
                cand = cand[cand >= n - 1]
                cand = cand[arr[cand - (n - 1)] == arr[length - n]]
            if cand.size == 0:
                break
            if n >= self.n_min:
                best = int(cand[-1])  # the most recent occurrence of the longest match
        if best is None:
            return []
        return token_ids[best + 1:best + 1 + k]


def accept(row_tokens: list[int], drafts: list[int]) -> list[int]:
    """The tokens a verified step emits: row j's token while it equals draft
    j (the drafts it confirms), then the first token that differs, or the
    last row's token when every draft held. len(row_tokens) == len(drafts) + 1."""
    for j, d in enumerate(drafts):
        if row_tokens[j] != d:
            return row_tokens[:j + 1]
    return list(row_tokens)


def speculates(seq) -> bool:
    """Whether a decoding sequence's sampling is the same for every row of a
    verified step (see the module docstring)."""
    p = seq.params
    return (seq.matcher is None and p.repetition_penalty == 1.0 and not p.presence_penalty
            and not p.frequency_penalty and seq.num_output_tokens >= p.min_tokens)


@dataclass
class SpecStats:
    """Counters for /metrics: drafts proposed and accepted, and the tokens
    decoding sequences emitted per step (1 without speculation)."""
    num_drafts: int = 0  # verified steps (a sequence with >= 1 draft)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_decode_steps: int = 0  # decoding sequence-steps, with or without drafts
    num_decode_tokens: int = 0  # tokens those steps emitted

    def record(self, num_drafts: int, num_emitted: int) -> None:
        self.num_decode_steps += 1
        self.num_decode_tokens += num_emitted
        if num_drafts:
            self.num_drafts += 1
            self.num_draft_tokens += num_drafts
            self.num_accepted_tokens += num_emitted - 1

    def as_dict(self) -> dict:
        return {
            "spec_decode_num_drafts": self.num_drafts,
            "spec_decode_num_draft_tokens": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
            "spec_decode_acceptance_rate": self.num_accepted_tokens / self.num_draft_tokens
            if self.num_draft_tokens else 0.0,
            "spec_decode_tokens_per_step": self.num_decode_tokens / self.num_decode_steps
            if self.num_decode_steps else 0.0,
        }


@dataclass
class SampleRows:
    """How a step's logits rows map to the sequences that sample: sequence i
    (after n > 1 forks) samples rows ``spans[i]`` of the rows handed to the
    sampler, which are ``logit_rows`` of the model runner's logits; a forked
    child shares its parent's rows (a child has just finished its prompt,
    so it has no drafts)."""
    row_seqs: list
    row_drafts: list  # per sampler row: the draft token it verifies, or None
    logit_rows: list[int]
    spans: list[range]

    @classmethod
    def build(cls, sample_seqs: list, seqs: list, rows: list[int], drafts: dict) -> "SampleRows":
        """sample_seqs: the runner's sampling sequences (its logits order);
        seqs[i] samples from sample_seqs[rows[i]]; drafts: seq_id -> drafts."""
        first, at = [], 0
        for s in sample_seqs:
            first.append(at)
            at += 1 + len(drafts.get(s.seq_id, ()))
        out = cls([], [], [], [])
        for seq, row in zip(seqs, rows):
            d = drafts.get(sample_seqs[row].seq_id, [])
            out.spans.append(range(len(out.row_seqs), len(out.row_seqs) + 1 + len(d)))
            out.row_seqs += [seq] * (1 + len(d))
            out.row_drafts += list(d) + [None]
            out.logit_rows += range(first[row], first[row] + 1 + len(d))
        return out


def draft_rows(last_rows: np.ndarray, drafts: list[list[int]]) -> np.ndarray:
    """The model runner's sampling rows. last_rows: each sampling sequence's
    final row in the step; with d drafts that is the last draft's, and the
    sequence samples rows r - d .. r (its last known token, then each draft)."""
    if not any(drafts):
        return last_rows
    return np.concatenate([np.arange(r - len(d), r + 1) for r, d in zip(last_rows.tolist(), drafts)])
