"""Issue 22, item 1: a request that fails inside an engine step fails alone.

The failure is real, not injected into the model: a request's logit_bias
gets a value that is no number after SamplingParams validated it (as a bug
elsewhere could leave it), so the sampler raises for that row only.
The oracle for everyone else is the same prompt run alone.
"""

import asyncio
import os

import pytest

from conftest import step_until_idle

from paged.core.entrypoints.async_engine import AsyncEngine, EngineStepError
from paged.core.engine.engine import Engine
from paged.core.engine.config import EngineConfig
from paged.core.entrypoints.llm import LLM
from paged.core.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def broken_params() -> SamplingParams:
    params = SamplingParams(temperature=0.0, max_tokens=8)
    params.logit_bias = {5: "not a number"}  # torch.tensor() of it raises inside the sampler
    return params


@pytest.fixture(scope="module")
def engine(default_model_path):
    return Engine(EngineConfig(model=str(default_model_path), device="cpu", dtype="float32", max_model_len=256,
                               max_num_seqs=2, kv_cache_memory="64MiB", block_size=16,
                               cpu_threads_bind=str(min(os.sched_getaffinity(0)))))


@pytest.fixture(scope="module")
def alone(engine):
    llm = LLM.from_engine(engine)
    return {p: llm.generate(p, GREEDY)[0].outputs[0].token_ids for p in ("Hello there", "One, two,", "Blue")}


def test_step_fails_only_the_request_it_belongs_to(engine, alone):
    engine.add_request("ok", "Hello there", GREEDY)
    engine.add_request("bad", "One, two,", broken_params())
    engine.add_request("queued", "Blue", GREEDY)  # max_num_seqs 2: waits behind the others
    final, failures = step_until_idle(engine)
    assert list(failures) == ["bad"]
    assert final["ok"].outputs[0].token_ids == alone["Hello there"]
    assert final["queued"].outputs[0].token_ids == alone["Blue"]
    kv = engine.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks  # the failed request's blocks came back


def test_async_engine_fails_one_client_and_serves_the_rest(engine, alone):
    async def run(aengine, rid, prompt, params):
        try:
            async for out in aengine.generate(rid, prompt, params):
                last = out
            return last.outputs[0].token_ids
        except EngineStepError as exc:
            return exc

    async def main():
        aengine = AsyncEngine(engine)
        aengine.start()
        try:
            return await asyncio.gather(run(aengine, "a", "Hello there", GREEDY),
                                        run(aengine, "b", "One, two,", broken_params()),
                                        run(aengine, "c", "Blue", GREEDY))
        finally:
            aengine.shutdown()

    ok, bad, queued = asyncio.run(main())
    assert ok == alone["Hello there"] and queued == alone["Blue"]
    assert isinstance(bad, EngineStepError), bad
