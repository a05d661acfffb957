"""--dtype bfloat16 through the whole Engine on the CPU (the default model).

Activations are rounded to bfloat16 between ops (8 mantissa bits), so the
path promises no bitwise batch invariance (docs/kernels.md, "Batch
invariance, per CPU path"): a last-bit difference in a linear can flip a
near-tie. What it does promise, checked here against the same engine running
each prompt alone: batched, chunked-prefill and preempted runs give the same
greedy tokens up to the first step where the alone run's top-2 logprob
margin is below MARGIN, and every block returns to the pool. Its agreement
with HF float32 is the accuracy gate's (tests/test_accuracy_gate.py).
"""

from __future__ import annotations

import os

import pytest
import torch

from paged.core.engine.engine import Engine
from paged.core.engine.config import EngineConfig
from paged.core.entrypoints.llm import LLM
from paged.core.engine.sampling_params import SamplingParams

PROMPTS = ["The capital of France is", "def fib(n):", "Once upon a time", "List three colors:",
           "1, 2, 3, 4,", "The quick brown fox"]
NEW = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=2)
#: bf16 hidden states move logits by up to ~0.1 between schedules
MARGIN = 0.25


@pytest.fixture(scope="module")
def llm(default_model_path):
    engine = Engine(EngineConfig(model=str(default_model_path), device="cpu", dtype="bfloat16", max_model_len=512,
                                 max_num_seqs=16, max_num_batched_tokens=256, kv_cache_memory="64MiB",
                                 block_size=16, cpu_threads_bind=str(min(os.sched_getaffinity(0)))))
    assert engine.dtype == torch.bfloat16 and engine.kv_cache_dtype == torch.bfloat16
    return LLM.from_engine(engine)


@pytest.fixture(scope="module")
def alone(llm):
    return [llm.generate(p, GREEDY)[0].outputs[0] for p in PROMPTS]


def assert_same_up_to_near_ties(outs, alone) -> None:
    for out, ref in zip(outs, alone):
        got = out.outputs[0].token_ids
        k = next((i for i, (a, b) in enumerate(zip(got, ref.token_ids)) if a != b), None)
        if k is not None:
            top = sorted(ref.logprobs[k].values(), reverse=True)
            assert top[0] - top[1] < MARGIN, f"{out.prompt!r}: token {k} differs at a margin of {top[0] - top[1]:.3f}"
        assert len(got) == NEW


def all_free(llm) -> bool:
    kv = llm.engine.kv_cache_manager
    return kv.num_free_blocks == kv.num_blocks


def test_batched_equals_alone_up_to_near_ties(llm, alone):
    assert_same_up_to_near_ties(llm.generate(PROMPTS * 2, GREEDY), alone * 2)
    assert all_free(llm)


def test_chunked_prefill_equals_alone_up_to_near_ties(llm, alone):
    sched = llm.engine.scheduler
    saved, sched.max_num_batched_tokens = sched.max_num_batched_tokens, 8
    try:
        outs = llm.generate(PROMPTS, GREEDY)
    finally:
        sched.max_num_batched_tokens = saved
    assert_same_up_to_near_ties(outs, alone)


def test_preemption_equals_alone_up_to_near_ties(llm, alone):
    kv = llm.engine.kv_cache_manager
    hog = kv.num_free_blocks - 3
    assert kv.allocate_slots("hog", [0] * (hog * kv.block_size), 0, hog * kv.block_size) is not None
    try:
        before = llm.engine.scheduler.num_preemptions
        outs = llm.generate(PROMPTS, GREEDY)
        assert llm.engine.scheduler.num_preemptions > before
    finally:
        kv.free("hog")
    assert_same_up_to_near_ties(outs, alone)
    assert all_free(llm)
