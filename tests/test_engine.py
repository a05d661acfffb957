"""The Engine end to end on the CPU backend with the real default model, on
the default path (auto) and on float32 activations (--linear-activations
float32, whose prompt chunks of PAGED_DENSE_PREFILL_ROWS rows and more run
as a dense GEMM), each at every ISA level this CPU has.

The oracle for batching, chunked prefill, preemption and prefix caching is
the same engine running each prompt alone: the default path is bitwise batch
invariant, the float32 path equal to float32 rounding (docs/kernels.md,
"Batch invariance, per CPU path"), so every schedule must give identical
greedy tokens on these prompts.
"""

import os

import pytest

from paged.core.engine.engine import Engine
from paged.core.engine.config import EngineConfig
from paged.core.entrypoints.llm import LLM
from paged.core.engine.sampling_params import SamplingParams

PROMPTS = ["The capital of France is", "def fib(n):", "Once upon a time", "List three colors:",
           "1, 2, 3, 4,", "The quick brown fox", "Water boils at", "In 1492, Columbus"]
NEW = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)


def one_cpu() -> str:
    """Tests pin one thread: on a shared 2-core machine a 2-thread OpenMP
    region waits for a descheduled sibling and runs several times slower."""
    return str(min(os.sched_getaffinity(0)))


@pytest.fixture(scope="module", params=["auto", "float32"])
def engine(request, default_model_path, isa_level):
    # 16-token blocks (not the CPU default of 128): these short prompts then
    # span several blocks, so preemption, prefix hits and block reuse are
    # exercised. test_engine_parity runs the default block size.
    return Engine(EngineConfig(model=str(default_model_path), device="cpu", dtype="float32", max_model_len=512,
                               max_num_seqs=16, max_num_batched_tokens=256, kv_cache_memory="128MiB",
                               block_size=16, cpu_threads_bind=one_cpu(), linear_activations=request.param))


@pytest.fixture(scope="module")
def llm(engine):
    return LLM.from_engine(engine)


@pytest.fixture(scope="module")
def alone(llm):
    return [llm.generate(p, GREEDY)[0].outputs[0].token_ids for p in PROMPTS]


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def all_free(engine):
    kv = engine.kv_cache_manager
    return kv.num_free_blocks == kv.num_blocks


def test_batched_with_15_others_equals_alone(llm, engine, alone):
    outs = llm.generate(PROMPTS * 2, GREEDY)
    assert tokens(outs) == alone * 2
    assert all(o.outputs[0].finish_reason == "length" and len(o.outputs[0].token_ids) == NEW for o in outs)
    assert all_free(engine)


def test_tiny_chunked_prefill_budget_equals_alone(llm, engine, alone):
    sched = engine.scheduler
    saved = sched.max_num_batched_tokens
    sched.max_num_batched_tokens = 16
    try:
        long_prompt = " ".join(PROMPTS)  # several chunks
        ref = llm.generate(long_prompt, GREEDY)[0].outputs[0].token_ids
        outs = llm.generate(PROMPTS + [long_prompt], GREEDY)
    finally:
        sched.max_num_batched_tokens = saved
    assert tokens(outs) == alone + [ref]


def test_long_prompt_in_one_chunk_equals_small_chunks(llm, engine, monkeypatch):
    """A prompt prefilled in one large chunk and in 32-token chunks gives the
    same greedy tokens. On float32 activations the large chunk runs the
    packed weights as a dense GEMM (PAGED_DENSE_PREFILL_ROWS rows and more,
    backends/cpu/quant_linear.py), the small ones the packed kernel."""
    from paged.backends.cpu import quant_linear

    dense_calls = []
    monkeypatch.setattr(quant_linear.CpuPackedLinear, "_dequantized",
                        lambda self, f=quant_linear.CpuPackedLinear._dequantized: dense_calls.append(1) or f(self))

    long_prompt = " ".join(PROMPTS * 6)
    n = len(engine.tokenizer.encode(long_prompt))
    assert n > quant_linear.DENSE_ROWS > 0, (n, quant_linear.DENSE_ROWS)
    sched, kv = engine.scheduler, engine.kv_cache_manager
    saved = sched.max_num_batched_tokens
    kv.enable_prefix_caching = False  # the second run must recompute the prompt
    try:
        sched.max_num_batched_tokens = 512
        one_chunk = llm.generate(long_prompt, GREEDY)[0].outputs[0].token_ids
        sched.max_num_batched_tokens = 32
        chunked = llm.generate(long_prompt, GREEDY)[0].outputs[0].token_ids
    finally:
        sched.max_num_batched_tokens = saved
        kv.enable_prefix_caching = True
    assert one_chunk == chunked
    assert bool(dense_calls) == (engine.linear_activations == "float32")  # the dense branch ran where it exists


def test_forced_preemption_equals_alone(llm, engine, alone):
    kv = engine.kv_cache_manager
    bs = kv.block_size
    # leave 4 free blocks: 8 sequences of ~16 tokens need about 16, so the newest are preempted
    hog = kv.num_free_blocks - 4
    assert kv.allocate_slots("hog", [0] * (hog * bs), 0, hog * bs) is not None
    try:
        before = engine.scheduler.num_preemptions
        outs = llm.generate(PROMPTS, GREEDY)
        assert engine.scheduler.num_preemptions > before
    finally:
        kv.free("hog")
    assert tokens(outs) == alone
    assert all_free(engine)


def test_prefix_cache_hit_same_as_miss(llm, engine):
    system = "You are a helpful assistant who answers questions about geography briefly. " * 2
    prompt = system + "Q: What is the capital of Italy? A:"
    miss = llm.generate(prompt, GREEDY)[0]
    hit = llm.generate(prompt, GREEDY)[0]
    assert miss.metrics.num_cached_tokens == 0
    assert hit.metrics.num_cached_tokens >= engine.kv_cache_manager.block_size
    assert hit.outputs[0].token_ids == miss.outputs[0].token_ids


def test_seeded_sampling_alone_and_batched(llm):
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=4321, max_tokens=NEW, ignore_eos=True)
    other = SamplingParams(temperature=1.0, max_tokens=NEW, ignore_eos=True)
    solo = llm.generate(PROMPTS[2], seeded)[0].outputs[0].token_ids
    outs = llm.generate(PROMPTS[:5], [other, other, seeded, other, other])
    assert outs[2].outputs[0].token_ids == solo
    assert llm.generate(PROMPTS[2], seeded)[0].outputs[0].token_ids == solo


def test_n_samples_share_the_prompt(llm, engine, alone):
    outs = llm.generate(PROMPTS[0], SamplingParams(n=3, temperature=0.0, max_tokens=NEW, ignore_eos=True))[0]
    assert [c.index for c in outs.outputs] == [0, 1, 2]
    assert all(c.token_ids == alone[0] for c in outs.outputs)
    sampled = llm.generate(PROMPTS[0], SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=NEW))[0]
    assert len(sampled.outputs) == 2 and all(c.finish_reason for c in sampled.outputs)
    assert all_free(engine)


def test_stop_string_across_tokens_and_max_tokens(llm, engine, alone):
    tok = engine.tokenizer
    ids = alone[1]
    full = tok.decode(ids)
    # a stop string spanning the boundary between output tokens 3 and 4
    head = tok.decode(ids[:4])
    stop = head[-2:] + full[len(head):len(head) + 2]
    assert len(stop) == 4 and stop in full
    out = llm.generate(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=NEW, stop=stop))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full[:full.index(stop)]
    out = llm.generate(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=NEW, stop=stop,
                                                  include_stop_str_in_output=True))[0].outputs[0]
    assert out.text == full[:full.index(stop) + len(stop)]
    short = llm.generate(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=3))[0].outputs[0]
    assert short.token_ids == ids[:3] and short.finish_reason == "length"


def test_stop_token_and_eos(llm, engine, alone):
    ids = alone[0]
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=NEW, stop_token_ids=[ids[2]]))[0]
    c = out.outputs[0]
    first = ids.index(ids[2])
    assert c.token_ids == ids[:first + 1] and c.finish_reason == "stop" and c.stop_reason == ids[2]
    chat = llm.chat([{"role": "user", "content": "Say hi."}], SamplingParams(temperature=0.0, max_tokens=64))[0]
    c = chat.outputs[0]
    if c.finish_reason == "stop":  # the instruct model ends its turn with EOS, which is not in the text
        assert c.token_ids[-1] == engine.eos_token_id and "<|im_end|>" not in c.text


def test_logprobs_and_prompt_logprobs(llm, engine):
    p = SamplingParams(temperature=0.0, max_tokens=4, logprobs=3, prompt_logprobs=2)
    out = llm.generate(PROMPTS[3], p)[0]
    c = out.outputs[0]
    assert len(c.logprobs) == 4
    for tid, lp in zip(c.token_ids, c.logprobs):
        assert tid in lp and lp[tid] == max(lp.values())  # greedy: the chosen token is the top one
        assert 3 <= len(lp) <= 4
    assert c.cumulative_logprob == pytest.approx(sum(lp[t] for t, lp in zip(c.token_ids, c.logprobs)))
    plp = out.prompt_logprobs
    assert len(plp) == len(out.prompt_token_ids) and plp[0] is None
    assert all(t in d and all(v <= 0 for v in d.values()) for t, d in zip(out.prompt_token_ids[1:], plp[1:]))


def test_abort_frees_all_blocks(engine):
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"abort-{i}", p * 3, SamplingParams(max_tokens=50))
    for _ in range(3):
        engine.step()
    for i in range(len(PROMPTS)):
        out = engine.abort_request(f"abort-{i}")
        assert out is None or out.outputs[0].finish_reason == "abort"
    assert not engine.has_unfinished_requests() and all_free(engine)
    assert engine.step() == []


def test_bad_input_is_a_clear_error(engine, llm):
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("bad1", [], SamplingParams())
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request("bad2", [1] * 600, SamplingParams())
    with pytest.raises(ValueError, match="vocabulary"):
        engine.add_request("bad3", [1, 10**9], SamplingParams())
    with pytest.raises(ValueError, match="params has 2 entries"):
        llm.generate(["a", "b", "c"], [GREEDY, GREEDY])
    with pytest.raises(ValueError, match="prompts"):
        llm.generate(3.5)
    assert not engine.has_unfinished_requests()


def test_outputs_in_input_order_and_stats(llm, engine):
    outs = llm.generate([PROMPTS[5], PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=2))
    assert [o.prompt for o in outs] == [PROMPTS[5], PROMPTS[0]]
    s = engine.stats()
    assert s["num_running"] == 0 and s["kv_cache"]["used"] == 0 and s["generation_tokens"] > 0
