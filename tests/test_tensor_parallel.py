"""Tensor parallelism end to end on the CPU: ranks are real processes, their
collectives gloo over loopback, one pinned thread each (2 cores here).

Oracle: the same engine at -tp 1. The default path's greedy output of the
default model (9 query heads, 3 KV heads) at -tp 2 (an uneven 2 + 1 KV-group
split) and -tp 3 (even) must equal it bit for bit: the same tokens, the same
logprobs of every prompt and generated token (the output projections compute
every value as one process does: core/engine/distributed/sharding.py). Killing a
rank must end the group with an error naming it, within seconds.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from paged.backends.cpu.quant_linear import resolve_activations
from paged.core.engine.distributed.layout import RankFailed
from paged.core.engine.engine import Engine, StepFailed
from paged.core.engine.config import EngineConfig
from paged.core.entrypoints.llm import LLM
from paged.core.engine.sampling_params import SamplingParams

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "List three colours of the rainbow:",
    "Water boils at a temperature of",
    "Once upon a time, in a small village,",
]
MAX_TOKENS = 12


def make_engine(tp: int, bind: str) -> Engine:
    # the default path (auto: mixed activations, float16 cache on the CPU)
    return Engine(EngineConfig(tensor_parallel_size=tp, cpu_threads_bind=bind, num_kv_blocks=16, max_num_seqs=8,
                               max_model_len=512))


def greedy(engine: Engine):
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=2, prompt_logprobs=5,
                            ignore_eos=True)
    return LLM.from_engine(engine).generate(PROMPTS, params)


@pytest.fixture(scope="module")
def reference(default_model_path):
    engine = make_engine(1, "0")
    try:
        return greedy(engine)
    finally:
        engine.close()


def compare(reference, outputs) -> None:
    """Bitwise: the same tokens and the same logprobs, prompt and generated."""
    for ref, out in zip(reference, outputs):
        r, o = ref.outputs[0], out.outputs[0]
        assert o.token_ids == r.token_ids, f"{ref.prompt!r}: -tp 1 {r.token_ids}, got {o.token_ids}"
        assert out.prompt_logprobs == ref.prompt_logprobs, f"{ref.prompt!r}: prompt logprobs differ"
        assert o.logprobs == r.logprobs, f"{ref.prompt!r}: logprobs differ"


def test_a_rank_failing_at_start_is_named(default_model_path, capfd):
    with pytest.raises(RankFailed, match="tensor parallel rank 1 exited with code 1"):
        make_engine(2, "0|99")  # rank 1's CPU list names a CPU this machine lacks
    assert "paged: error: tensor parallel rank 1: ValueError: --cpu-threads-bind" in capfd.readouterr().err


class _Child:
    def __init__(self, exitcode):
        self.exitcode = exitcode


@pytest.mark.parametrize("exitcode, message", [(None, "tensor parallel rank 1 did not join within 0.3 s"),
                                               (3, "tensor parallel rank 1 exited with code 3 before joining")])
def test_join_waits_for_every_rank_and_names_the_missing_one(monkeypatch, exitcode, message):
    import torch.distributed as dist

    from paged.core.engine.distributed import group as g

    store = dist.TCPStore("127.0.0.1", 0, 3, is_master=True, wait_for_workers=False)
    store.set("paged/joined/2", "1")  # rank 2 joined, rank 1 never does
    monkeypatch.setattr(g, "JOIN_TIMEOUT_S", 0.3)
    with pytest.raises(RankFailed, match=message):
        g._await_joins(store, g.RankGroup(children={1: _Child(exitcode), 2: _Child(None)}), 3)


@pytest.fixture(scope="module")
def tp2(default_model_path):
    """One -tp 2 engine for the module's last tests (the last kills a rank);
    one process holds one group at a time, so -tp 3 runs before it."""
    with LLM(tensor_parallel_size=2, cpu_threads_bind="0|1", num_kv_blocks=16, max_num_seqs=8,
             max_model_len=512) as llm:  # the offline API's way in
        yield llm.engine


def check_against_reference(engine: Engine, reference) -> None:
    tp = engine.worker.world_size
    assert engine.worker.model.layer_stack is None  # off under tensor parallelism
    assert tp > 1 and engine.linear_activations == resolve_activations("auto")  # the default path
    compare(reference, greedy(engine))
    assert engine.stats()["kv_cache"]["used"] == 0  # every block back in rank 0's pool


def test_tp3_even_greedy_equals_one_rank(reference):
    engine = make_engine(3, "0|1|1")
    try:
        check_against_reference(engine, reference)
    finally:
        engine.close()


def test_one_group_per_process(tp2):
    with pytest.raises(ValueError, match="one tensor parallel engine per process"):
        make_engine(2, "0|1")
    assert tp2.worker.group.stopped is None


def test_tp2_uneven_kv_groups_greedy_equals_one_rank(reference, tp2):
    assert tp2.worker.shard.kv_heads == (0, 2)  # rank 0: 2 KV groups, rank 1: 1
    check_against_reference(tp2, reference)


def test_tp2_copy_on_write_reaches_every_rank(reference, tp2):
    # n = 2 forks the prompt's blocks; the first write to the shared last
    # block copies it (rank 0 decides, every rank must copy its own heads)
    params = SamplingParams(n=2, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    out = LLM.from_engine(tp2).generate(PROMPTS[0], params)[0]
    want = reference[0].outputs[0].token_ids
    assert [c.token_ids for c in out.outputs] == [want, want]
    assert tp2.stats()["kv_cache"]["used"] == 0


def test_killing_a_rank_stops_the_group_naming_it(tp2):
    child = tp2.group.children[1]
    os.kill(child.pid, signal.SIGKILL)
    t0 = time.monotonic()
    tp2.add_request("r", "Hello", SamplingParams(max_tokens=4))
    with pytest.raises(StepFailed, match="tensor parallel rank 1 was killed by signal 9"):
        while tp2.has_unfinished_requests():
            tp2.step()
    assert time.monotonic() - t0 < 10
    tp2.add_request("r2", "Hello", SamplingParams(max_tokens=4))
    with pytest.raises(StepFailed, match="rank 1 was killed"):  # the group stays stopped
        tp2.step()
