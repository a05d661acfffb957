"""Scheduler unit tests with a real KVCacheManager and no model.

A tiny driver plays the engine: it advances the scheduled tokens and
appends a deterministic "sampled" token (a function of the sequence so far)
to every sequence that samples, so a preempted-and-recomputed sequence must
end with exactly the tokens it would have produced without preemption.
"""

import random

import pytest

from paged.core.engine.kv_cache_manager import KVCacheManager
from paged.core.engine.request import Request
from paged.core.engine.sampling_params import SamplingParams
from paged.core.engine.scheduler import Scheduler, WaitingQueueFull

BS = 4


def fake_token(token_ids):
    return (sum(token_ids) * 31 + len(token_ids)) % 1000


def make(num_blocks=64, max_num_seqs=8, budget=16, prefix=True, max_waiting=None):
    kv = KVCacheManager(num_blocks, BS, enable_prefix_caching=prefix)
    return kv, Scheduler(kv, max_num_seqs, budget, max_waiting, prefix)


def add(sched, rid, prompt, max_tokens):
    req = Request(rid, None, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    sched.add_request(req)
    return req


def step(sched, max_tokens):
    """One engine step without a model; returns the SchedulerOutput."""
    out = sched.schedule()
    sched.advance(out)
    for e in out.scheduled:
        if e.samples:
            seq = e.seq
            seq.token_ids.append(fake_token(seq.token_ids))
            if seq.num_output_tokens >= max_tokens[seq.group.request_id]:
                seq.finish("length")
                sched.finish_seq(seq)
    return out


def run_all(sched, max_tokens, check=None, limit=10_000):
    for _ in range(limit):
        if not sched.has_unfinished():
            return
        out = step(sched, max_tokens)
        if check:
            check(out)
    raise AssertionError("scheduler made no progress")


def expected_output(prompt, n):
    toks = list(prompt)
    for _ in range(n):
        toks.append(fake_token(toks))
    return toks[len(prompt):]


def test_decodes_first_then_prefill_chunks_within_budget():
    kv, sched = make(budget=8)
    a = add(sched, "a", list(range(1, 6)), 4)
    out = step(sched, {"a": 4, "b": 4})
    assert [e.num_new_tokens for e in out.prefills] == [5] and not out.decodes
    b = add(sched, "b", list(range(10, 30)), 4)  # 20-token prompt: chunked
    out = sched.schedule()
    assert [e.seq.seq_id for e in out.decodes] == ["a"]
    assert [(e.seq.seq_id, e.start, e.num_new_tokens) for e in out.prefills] == [("b", 0, 7)]
    assert out.num_tokens == 8
    assert not out.prefills[0].samples and out.decodes[0].samples
    sched.advance(out)
    a.seqs[0].token_ids.append(1)
    out = sched.schedule()
    assert [e.seq.seq_id for e in out.decodes] == ["a"]
    assert [(e.start, e.num_new_tokens) for e in out.prefills] == [(7, 7)]


def test_positions_and_block_tables_cover_every_token():
    kv, sched = make(budget=6)
    add(sched, "a", list(range(1, 12)), 3)
    seen = []
    while sched.has_unfinished():
        out = sched.schedule()
        for e in out.scheduled:
            table = kv.block_table(e.seq.seq_id)
            assert len(table) * BS >= e.start + e.num_new_tokens
            seen.extend(range(e.start, e.start + e.num_new_tokens))
        step_out = out
        sched.advance(step_out)
        for e in step_out.scheduled:
            if e.samples:
                e.seq.token_ids.append(7)
                if e.seq.num_output_tokens >= 3:
                    e.seq.finish("length")
                    sched.finish_seq(e.seq)
    assert seen == list(range(11 + 2))  # the last generated token is never fed back
    assert kv.num_free_blocks == kv.num_blocks


def test_preemption_recomputes_newest_and_outputs_are_unchanged():
    prompts = {f"r{i}": [i + 1] * (5 + i) for i in range(4)}
    max_tokens = {rid: 12 for rid in prompts}
    kv, sched = make(num_blocks=9, budget=32, prefix=False)
    reqs = {rid: add(sched, rid, p, 12) for rid, p in prompts.items()}
    preempted = []

    def check(out):
        assert out.num_tokens <= 32
        preempted.extend(s.seq_id for s in out.preempted)
        used = kv.num_blocks - kv.num_free_blocks
        assert used <= kv.num_blocks

    run_all(sched, max_tokens, check)
    assert preempted, "the tiny cache should have forced a preemption"
    assert preempted[0] == "r3"  # the newest running request goes first
    for rid, req in reqs.items():
        assert req.seqs[0].output_token_ids == expected_output(prompts[rid], 12)
    assert kv.num_free_blocks == kv.num_blocks
    assert sched.num_preemptions == len(preempted)


def test_preempted_request_goes_to_front_of_waiting_queue():
    kv, sched = make(num_blocks=4, budget=32, max_num_seqs=2, prefix=False)
    add(sched, "old", [1] * 7, 20)
    add(sched, "new", [2] * 7, 20)
    add(sched, "later", [3] * 3, 20)
    for _ in range(50):
        out = step(sched, {"old": 20, "new": 20, "later": 20})
        if out.preempted:
            break
    assert [s.seq_id for s in out.preempted] == ["new"]
    assert sched.waiting[0].seq_id == "new" and sched.waiting[1].seq_id == "later"
    new = sched.waiting[0]
    assert new.num_computed_tokens == 0 and new.prefill_target == len(new.token_ids) > 7


def test_abort_frees_everything_at_any_moment():
    kv, sched = make(num_blocks=16, budget=5)
    add(sched, "a", list(range(1, 14)), 30)
    add(sched, "b", list(range(20, 30)), 30)
    step(sched, {"a": 30, "b": 30})  # a is mid-prefill, b waiting
    assert sched.abort_request("a").seqs[0].finish_reason == "abort"
    assert sched.abort_request("a") is None
    for _ in range(4):
        step(sched, {"b": 30})
    req_b = sched.abort_request("b")
    assert req_b.finished
    assert not sched.has_unfinished()
    assert kv.num_free_blocks == kv.num_blocks


def test_prefix_cache_hit_at_admission():
    kv, sched = make(num_blocks=32, budget=64)
    prompt = list(range(1, 14))  # 13 tokens: 3 full blocks
    add(sched, "a", prompt, 2)
    run_all(sched, {"a": 2})
    add(sched, "b", prompt, 2)
    out = sched.schedule()
    (e,) = out.prefills
    assert e.start == 12 and e.num_new_tokens == 1
    assert e.seq.group.metrics.num_cached_tokens == 12


def test_waiting_queue_bound_and_duplicate_ids():
    kv, sched = make(max_waiting=2)
    add(sched, "a", [1, 2], 1)
    add(sched, "b", [1, 2], 1)
    with pytest.raises(WaitingQueueFull):
        add(sched, "c", [1, 2], 1)
    with pytest.raises(ValueError, match="'a'"):
        add(sched, "a", [1, 2], 1)


def test_max_num_seqs_caps_the_batch():
    kv, sched = make(max_num_seqs=3, budget=100)
    for i in range(6):
        add(sched, f"r{i}", [i + 1] * 3, 4)
    out = sched.schedule()
    assert len(out.scheduled) == 3 and len(sched.waiting) == 3


def test_random_workload_invariants():
    rng = random.Random(0)
    kv, sched = make(num_blocks=20, max_num_seqs=5, budget=12, prefix=True)
    prompts, max_tokens, reqs = {}, {}, {}
    shared = [9, 8, 7, 6, 5, 4, 3, 2]
    for i in range(25):
        p = (shared if i % 3 == 0 else []) + [rng.randrange(1, 50) for _ in range(rng.randrange(1, 20))]
        rid = f"r{i}"
        prompts[rid], max_tokens[rid] = p, rng.randrange(1, 10)
        reqs[rid] = add(sched, rid, p, max_tokens[rid])

    def check(out):
        assert out.num_tokens <= 12
        assert len(sched.running) <= 5
        ids = [e.seq.seq_id for e in out.scheduled]
        assert len(ids) == len(set(ids))
        assert all(e.num_new_tokens == 1 for e in out.decodes)
        if rng.random() < 0.03 and sched.running:
            sched.abort_request(rng.choice(sched.running).group.request_id)

    run_all(sched, max_tokens, check)
    for rid, req in reqs.items():
        seq = req.seqs[0]
        if seq.finish_reason != "abort":
            assert seq.output_token_ids == expected_output(prompts[rid], max_tokens[rid])
    assert kv.num_free_blocks == kv.num_blocks


def test_prefill_is_capped_while_decodes_run_and_outputs_are_unchanged():
    kv = KVCacheManager(64, BS, enable_prefix_caching=True)
    sched = Scheduler(kv, 8, 32, None, True, max_prefill_tokens_with_decodes=5)
    prompts = {"a": list(range(1, 4)), "b": list(range(10, 50)), "c": list(range(60, 90))}
    max_tokens = {rid: 6 for rid in prompts}
    reqs = {}
    reqs["a"] = add(sched, "a", prompts["a"], 6)
    out = step(sched, max_tokens)
    assert [e.num_new_tokens for e in out.prefills] == [3]  # no decodes yet: the whole budget is open
    reqs["b"] = add(sched, "b", prompts["b"], 6)
    reqs["c"] = add(sched, "c", prompts["c"], 6)

    def check(out):
        prefill = sum(e.num_new_tokens for e in out.prefills)
        assert prefill <= (5 if out.decodes else 32)
        assert out.num_tokens <= 32

    run_all(sched, max_tokens, check)
    for rid, req in reqs.items():
        assert req.seqs[0].token_ids[len(prompts[rid]):] == expected_output(prompts[rid], 6)
    with pytest.raises(ValueError, match="max_prefill_tokens_with_decodes: expected an integer >= 1"):
        Scheduler(kv, 8, 32, max_prefill_tokens_with_decodes=0)


def test_prefill_cap_also_holds_while_only_verifies_run():
    """Speculative decoding: a step whose decoding sequences all carry drafts
    (verifies, no plain decodes) still caps the prompt chunks it adds."""

    class AlwaysDrafts:  # proposes `limit` copies of the last token
        def propose(self, token_ids, limit):
            return [token_ids[-1]] * min(limit, 2)

    kv = KVCacheManager(64, BS, enable_prefix_caching=False)
    sched = Scheduler(kv, 8, 32, None, False, max_prefill_tokens_with_decodes=5, proposer=AlwaysDrafts())
    add(sched, "a", list(range(1, 4)), 20)
    sched.advance(out := sched.schedule())
    out.prefills[0].seq.token_ids.append(7)  # a decodes from now on
    add(sched, "b", list(range(10, 50)), 4)
    out = sched.schedule()
    assert out.verifies and not out.decodes
    assert sum(e.num_new_tokens for e in out.prefills) == 5


def test_recompute_chunks_end_at_the_prompt_and_generated_rows_come_first():
    """After a preemption, a chunk never spans the original prompt's end, and
    chunks of recomputed generated tokens come before prompt chunks (the rows
    that generate tokens keep their place; AttentionMetadata.first_prompt_row)."""
    from paged.core.engine.scheduler import prompt_chunk

    kv, sched = make(budget=64, prefix=False)  # no prefix hits: the recompute starts at 0
    a = add(sched, "a", list(range(10)), 8).seqs[0]
    b = add(sched, "b", list(range(100, 107)), 8).seqs[0]
    for _ in range(4):
        step(sched, {"a": 8, "b": 8})
    assert a.num_output_tokens == 4 and prompt_chunk(a, 0, 14) == 10 and prompt_chunk(a, 10, 4) == 4
    assert prompt_chunk(a, 3, 5) == 5  # inside the prompt: unchanged
    for seq in (a, b):  # as the scheduler's preemption does
        kv.free(seq.seq_id)
        seq.reset_for_recompute()
    sched.running.clear()
    sched.waiting.extendleft([b, a])
    first = sched.schedule()
    assert [(e.seq.seq_id, e.start, e.num_new_tokens) for e in first.prefills] == [("a", 0, 10), ("b", 0, 7)]
    sched.advance(first)
    second = sched.schedule()
    starts = [(e.seq.seq_id, e.start, e.num_new_tokens) for e in second.prefills]
    assert starts == [("a", 10, 4), ("b", 7, 4)]  # both generated parts; none is a prompt chunk
    assert all(e.start >= e.seq.num_prompt_tokens for e in second.prefills)
