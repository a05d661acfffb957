"""The batch-invariance guarantee of each CPU compute path, exactly as
docs/kernels.md ("Batch invariance, per path") states it:

- int8, int8x2, mixed and mixed-bf16 (auto, the default, is one of the
  two) linear activations: a
  sequence's logits are bitwise the same alone and batched with others (any
  row count per call, chunked or whole prefill, prompt rows beside decode
  rows); checked here through the logprobs of every generated token.
- float32 activations: equal greedy tokens alone and batched
  (tests/test_engine.py and tests/test_server.py check it under batching,
  chunked prefill and preemption); logits agree to float32 rounding only,
  because a row's linear arithmetic depends on its call's row count.

Oracle: the same engine running each prompt alone.
"""

from __future__ import annotations

import os

import pytest

from paged.core.engine.engine import Engine
from paged.core.engine.config import EngineConfig
from paged.core.entrypoints.llm import LLM
from paged.core.engine.sampling_params import SamplingParams

PROMPTS = ["The capital of France is", "def fib(n):", "Once upon a time", "List three colors:",
           "1, 2, 3, 4,", "The quick brown fox", "Water boils at", "In 1492, Columbus",
           "A long prompt that spans more than one small prefill chunk so that batching splits it "
           "differently from running it alone: " + "words and more words " * 12]
PARAMS = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=3)


def run(llm, prompts):
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, PARAMS)]


@pytest.fixture(scope="module", params=[("int8", "int8"), ("int8x2", "int8x2"), ("mixed", "mixed"), ("auto", None)],
                ids=["int8", "int8x2", "mixed", "auto"])
def int8_llm(request, default_model_path, isa_level):
    from paged.backends.cpu.quant_linear import bf16_prompt_supported

    setting, resolved = request.param
    resolved = resolved or ("mixed-bf16" if bf16_prompt_supported() else "mixed")  # auto, at this level
    engine = Engine(EngineConfig(model=str(default_model_path), device="cpu", dtype="float32",
                                 linear_activations=setting, max_model_len=512, max_num_seqs=16,
                                 max_num_batched_tokens=48, max_prefill_tokens_with_decodes=16,
                                 kv_cache_memory="128MiB", block_size=16,
                                 cpu_threads_bind=str(min(os.sched_getaffinity(0)))))
    assert engine.linear_activations == resolved
    return LLM.from_engine(engine)


def test_int8_logprobs_bitwise_alone_and_batched(int8_llm):
    alone = [run(int8_llm, [p])[0] for p in PROMPTS]
    batched = run(int8_llm, PROMPTS * 2)
    for i, (tokens, logprobs) in enumerate(batched):
        want_tokens, want_logprobs = alone[i % len(PROMPTS)]
        assert tokens == want_tokens, f"prompt {i}"
        assert logprobs == want_logprobs, f"prompt {i}: logprobs differ from the run alone"


def test_prompts_chunked_beside_decodes_equal_alone(default_model_path):
    """The default path with prompts arriving while others decode and cut
    into 1-token chunks (the smallest a prefill budget gives): every
    sequence's tokens and logprobs are bitwise those of its run alone. (A
    SIMD attention reduction once depended on how many keys followed a row
    in its chunk; int8 prompt rows turned that last-bit difference into
    other tokens.)"""
    engine = Engine(EngineConfig(model=str(default_model_path), device="cpu", max_model_len=256, max_num_seqs=8,
                                 kv_cache_memory="64MiB", itl_target_ms=None, max_prefill_tokens_with_decodes=1,
                                 cpu_threads_bind=str(min(os.sched_getaffinity(0)))))
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)

    def finish(prompts, stagger):
        done = {}
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, params)
            for _ in range(stagger):
                done.update({o.request_id: o.outputs[0] for o in engine.step() if o.finished})
        while engine.has_unfinished_requests():
            done.update({o.request_id: o.outputs[0] for o in engine.step() if o.finished})
        return [(done[str(i)].token_ids, done[str(i)].logprobs) for i in range(len(prompts))]

    prompts = PROMPTS[:6]
    alone = [finish([p], 0)[0] for p in prompts]
    assert finish(prompts, 1) == alone
