"""The time-targeted prefill budget (core/engine/prefill_budget.py).

Unit part, no model: observations come from a known linear cost model
t = a + c_d * n_d + c_p * n_p with 5% Gaussian noise and 3% of steps 3x
slow (a shared machine); the oracle is that known model put through the
documented rule. Then the Scheduler applying the object's answer, and the
real engine on the default model: no step carrying decodes takes more prompt
tokens than the budget allowed at that step, and greedy outputs equal the
budget-off run's (int8x2 linears are bitwise batch invariant,
docs/kernels.md). No assert depends on how fast this machine is.
"""

from __future__ import annotations

import math
import os
import random

import pytest

from paged.core.engine.kv_cache_manager import KVCacheManager
from paged.core.engine.prefill_budget import FLOOR_SHARE, MIN_OBSERVATIONS, MIN_TOKENS, UNTRAINED_TOKENS, PrefillBudget
from paged.core.engine.request import Request
from paged.core.engine.sampling_params import SamplingParams
from paged.core.engine.scheduler import Scheduler

# a, c_d, c_p in seconds: ~2-core Zen 4 (16 decodes ~37 ms, ~1 ms a prompt token), 4x dearer, cheaper
COSTS = (0.005, 0.002, 0.001)
DEARER = (0.01, 0.004, 0.004)
CHEAPER = (0.0025, 0.001, 0.0003)
TARGET = 0.1
CAP = 512


def oracle_tokens(costs, target, n_d, cap=CAP):
    """The documented rule applied to the true costs."""
    a, c_d, c_p = costs
    decodes = a + c_d * n_d
    fits = math.floor((target - decodes) / c_p) if decodes < target else 0
    n = max(fits, MIN_TOKENS, math.floor(FLOOR_SHARE * decodes / c_p))
    return n if cap is None else min(n, cap)


def feed(budget, rng, costs, steps):
    """Steps as a server runs them: mixed decode / prompt rows, pure prefills."""
    for _ in range(steps):
        n_d = rng.choice([0, 4, 8, 12, 16, 16, 16])
        n_p = rng.choice([0, 0, 16, 40, 64, 128, 512]) if n_d else rng.choice([64, 256, 512])
        t = (costs[0] + costs[1] * n_d + costs[2] * n_p) * (1 + rng.gauss(0, 0.05))
        if rng.random() < 0.03:
            t *= 3
        budget.observe(n_d, n_p, t)


@pytest.mark.parametrize("seed", range(3))
def test_learns_the_known_costs_and_their_budget(seed):
    rng = random.Random(seed)
    budget = PrefillBudget(TARGET, CAP)
    feed(budget, rng, COSTS, 300)
    a, c_d, c_p = COSTS
    assert budget.token_cost_s == pytest.approx(c_p, rel=0.1)
    for n_d in (4, 16):
        assert budget.decode_time_s(n_d) == pytest.approx(a + c_d * n_d, rel=0.15)
        assert budget.tokens(n_d) == pytest.approx(oracle_tokens(COSTS, TARGET, n_d), rel=0.1)
    assert budget.last_tokens == budget.tokens(16)


@pytest.mark.parametrize("seed", range(3))
def test_adapts_when_the_costs_change(seed):
    rng = random.Random(seed)
    budget = PrefillBudget(TARGET, CAP)
    feed(budget, rng, COSTS, 300)
    feed(budget, rng, DEARER, 100)  # 4x dearer prompt tokens: the budget drops to the floor
    assert budget.tokens(16) == pytest.approx(oracle_tokens(DEARER, TARGET, 16), rel=0.15)
    feed(budget, rng, CHEAPER, 60)
    assert budget.tokens(16) == pytest.approx(oracle_tokens(CHEAPER, TARGET, 16), rel=0.15)


def test_floor_when_decodes_alone_exceed_the_target():
    """Prompts still get FLOOR_SHARE of the decodes' predicted time (a step at
    most ~1.5x the decode-only step), and never fewer than MIN_TOKENS."""
    rng = random.Random(7)
    budget = PrefillBudget(0.02, CAP)  # under the 37 ms a 16-decode step takes
    feed(budget, rng, COSTS, 300)
    want = oracle_tokens(COSTS, 0.02, 16)
    assert want == math.floor(FLOOR_SHARE * (COSTS[0] + 16 * COSTS[1]) / COSTS[2])  # the floor binds
    assert budget.tokens(16) == pytest.approx(want, rel=0.1)
    cheap_decodes = (0.001, 0.0001, 0.01)  # 16 decodes cost a quarter of one prompt token
    budget = PrefillBudget(0.05, CAP)
    feed(budget, rng, cheap_decodes, 300)
    assert oracle_tokens(cheap_decodes, 0.05, 16) == MIN_TOKENS
    assert budget.tokens(16) == MIN_TOKENS


def test_ceiling_is_the_cap():
    rng = random.Random(8)
    cheap_prompts = (0.005, 0.002, 1e-5)
    capped, uncapped = PrefillBudget(TARGET, CAP), PrefillBudget(TARGET, None)
    feed(capped, rng, cheap_prompts, 200)
    feed(uncapped, rng, cheap_prompts, 200)
    assert capped.tokens(16) == CAP
    assert uncapped.tokens(16) == pytest.approx(oracle_tokens(cheap_prompts, TARGET, 16, cap=None), rel=0.1)
    assert uncapped.tokens(16) > 10 * CAP


def test_a_small_chunk_until_enough_steps_were_seen():
    budget = PrefillBudget(TARGET, CAP)
    assert budget.stats() == {"prefill_budget_tokens": CAP, "prefill_token_cost_s": None}
    assert budget.tokens(16) == min(CAP, UNTRAINED_TOKENS) < CAP
    assert budget.stats() == {"prefill_budget_tokens": UNTRAINED_TOKENS, "prefill_token_cost_s": None}
    for _ in range(3 * MIN_OBSERVATIONS):
        budget.observe(16, 0, 0.037)  # decodes only: nothing says what a prompt token costs
    assert not budget.ready and budget.tokens(16) == UNTRAINED_TOKENS
    budget.observe(16, 64, 0.101)
    assert not budget.ready
    budget.observe(16, 128, 0.165)
    assert budget.ready and budget.tokens(16) < CAP
    assert PrefillBudget(TARGET, None).tokens(16) == UNTRAINED_TOKENS  # no cap, not ready
    assert PrefillBudget(TARGET, 8).tokens(16) == 8  # a cap below it wins


def test_bad_observations_are_ignored_and_predictions_stay_sane():
    budget = PrefillBudget(TARGET, CAP)
    for args in ((16, 0, float("nan")), (16, 0, float("inf")), (16, 0, -1.0), (0, 0, 0.01), (-1, 4, 0.01)):
        budget.observe(*args)
    assert budget.num_observed == 0
    rng = random.Random(9)
    for _ in range(500):  # adversarial: times unrelated to the rows, over 9 decades, long spells without prompts
        n_p = rng.choice([0] * 20 + [1, 512])
        budget.observe(rng.choice([0, 1, 64]), n_p, 10 ** rng.uniform(-6, 3) if n_p or rng.random() < 0.9 else 0.0)
        for n_d in (0, 1, 16, 64):
            assert 0.0 <= budget.decode_time_s(n_d) < math.inf
            n = budget.tokens(n_d)
            assert isinstance(n, int) and min(MIN_TOKENS, CAP) <= n <= CAP
        assert 0.0 < budget.token_cost_s < math.inf


@pytest.mark.parametrize("target, cap", [(0, 8), (-0.1, 8), (float("nan"), 8), (0.05, 0), (0.05, 1.5)])
def test_rejects_bad_arguments(target, cap):
    with pytest.raises(ValueError, match="expected"):
        PrefillBudget(target, cap)


def exported_metrics(stats: dict) -> dict[str, float]:
    """The server's /metrics text for these engine stats, parsed by prometheus_client."""
    from prometheus_client.parser import text_string_to_metric_families

    from paged.core.entrypoints.server.metrics import ServerMetrics

    text = ServerMetrics("m").render(stats, 0)
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if "le" not in s.labels}


class RecordingBudget(PrefillBudget):
    """A real budget that also records what the scheduler asked it."""

    def __init__(self, *args):
        super().__init__(*args)
        self.asked: list[tuple[int, int]] = []  # (decode rows, answer)

    def tokens(self, num_decode_rows):
        n = super().tokens(num_decode_rows)
        self.asked.append((num_decode_rows, n))
        return n


def test_scheduler_applies_the_budget_objects_answer():
    budget = RecordingBudget(0.03, 64)  # a, c_d, c_p = 5, 2, 1 ms: ~21 tokens beside 2 decodes
    feed(budget, random.Random(3), COSTS, 200)
    kv = KVCacheManager(64, 4, enable_prefix_caching=False)
    # the fixed cap (5) must not be what applies when a budget object is given
    sched = Scheduler(kv, 8, 96, None, False, max_prefill_tokens_with_decodes=5, prefill_budget=budget)
    for rid, prompt in (("a", [1, 2, 3]), ("b", [4, 5])):
        sched.add_request(Request(rid, None, prompt, SamplingParams(max_tokens=40, temperature=0.0)))
    out = sched.schedule()  # no decodes yet: the whole step budget, the object not asked
    assert sum(e.num_new_tokens for e in out.prefills) == 5 and not budget.asked
    sched.advance(out)
    for e in out.prefills:
        e.seq.token_ids.append(7)
    sched.add_request(Request("long", None, list(range(10, 90)), SamplingParams(max_tokens=4, temperature=0.0)))
    out = sched.schedule()
    assert len(out.decodes) == 2 and budget.asked == [(2, budget.last_tokens)]
    assert sum(e.num_new_tokens for e in out.prefills) == budget.last_tokens
    assert budget.last_tokens == pytest.approx(oracle_tokens(COSTS, 0.03, 2, 64), rel=0.15)


def test_engine_steps_stay_within_the_budget_and_outputs_are_unchanged(default_model_path):
    """The real engine: each step with decodes carries at most the prompt
    tokens the budget allowed at that step (a 1 ms target: the floor binds,
    chunks get small), and greedy tokens equal the budget-off run's."""
    from paged.core.engine.engine import Engine
    from paged.core.engine.config import EngineConfig

    engine = Engine(EngineConfig(model=str(default_model_path), device="cpu", dtype="float32",
                                 linear_activations="int8x2", max_model_len=512, max_num_seqs=8,
                                 max_num_batched_tokens=256, enable_prefix_caching=False, itl_target_ms=1.0,
                                 kv_cache_memory="64MiB", block_size=16,
                                 cpu_threads_bind=str(min(os.sched_getaffinity(0)))))
    budget = engine.scheduler.prefill_budget
    assert isinstance(budget, PrefillBudget) and budget.target_s == 0.001 and budget.cap == 512
    steps = []
    schedule = engine.scheduler.schedule

    def spy():
        budget.last_tokens = None
        out = schedule()
        steps.append((out, budget.last_tokens, budget.ready))
        return out

    engine.scheduler.schedule = spy
    long = "Tell me a story about a lighthouse keeper and a storm at sea. " * 6
    work = [("short", "The capital of France is", 0), ("a", long, 2), ("b", "List three colors: " + long, 6),
            ("c", long + " The end.", 10)]

    def run():
        outputs, pending, n = {}, list(work), 0
        while pending or engine.has_unfinished_requests():
            while pending and pending[0][2] <= n:  # the long prompts arrive while others decode
                rid, prompt, _ = pending.pop(0)
                engine.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
            outputs.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
            n += 1
        return outputs

    run()  # learns this machine's costs
    steps.clear()
    with_budget = run()
    bound = 0
    for out, allowed, ready in steps:
        prompt_tokens = sum(e.num_new_tokens for e in out.prefills)
        if out.decodes or out.verifies:
            assert allowed is not None and prompt_tokens <= allowed
            bound += ready and allowed < 512 and prompt_tokens > 0
        else:
            assert allowed is None  # not asked: a step without decodes fills the step budget
    assert bound >= 3, "the learned budget never limited a step"
    exported = exported_metrics(engine.stats())
    assert exported["paged:prefill_budget_tokens"] == budget.last_tokens
    assert exported["paged:prefill_token_cost_seconds"] == pytest.approx(budget.token_cost_s)
    engine.scheduler.prefill_budget = None  # off: only the fixed 512 cap
    assert run() == with_budget


def test_itl_target_option():
    import argparse

    from paged.core.engine.config import EngineConfig, add_engine_args, engine_config_from_args

    assert EngineConfig().itl_target_ms == 60.0 and EngineConfig().max_prefill_tokens_with_decodes == 512
    assert EngineConfig(itl_target_ms=0).itl_target_ms is None
    for bad in (-1, float("nan"), float("inf"), "60", True):
        with pytest.raises(ValueError, match=r"^--itl-target-ms: expected a number of milliseconds >= 0"):
            EngineConfig(itl_target_ms=bad)
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config_from_args(parser.parse_args(["--itl-target-ms", "25"])).itl_target_ms == 25.0
    assert engine_config_from_args(parser.parse_args(["--itl-target-ms", "0"])).itl_target_ms is None


def test_offline_llm_is_throughput_first_unless_asked(default_model_path):
    from paged.core.entrypoints.llm import LLM

    small = dict(device="cpu", max_model_len=128, max_num_seqs=2, kv_cache_memory="16MiB")
    assert LLM(str(default_model_path), **small).engine.scheduler.prefill_budget is None
    budget = LLM(str(default_model_path), itl_target_ms=60, **small).engine.scheduler.prefill_budget
    assert isinstance(budget, PrefillBudget) and budget.target_s == pytest.approx(0.06)
