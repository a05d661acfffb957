"""Steps carrying decodes and prompts under the time-targeted prefill budget
(--itl-target-ms, core/engine/prefill_budget.py) and under a fixed token cap,
through the engine, with the default model: what the engine learned, the
budget it chose, and how long mixed steps took.

    python benchmarks/prefill_budget.py [--itl-target-ms 60] [--fixed-cap 128] [--streams 16]
                                        [--cpu-threads-bind 0]

The workload: --streams short requests decoding 64 tokens, and four
~300-token prompts arriving (steps 8, 20, 32, 44) while they decode. It runs
twice per setting on one engine (the first pass warms up and teaches the
model) and reports the second. Step times are the forward's wall time; a
shared machine adds noise, so read medians.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from paged.core.engine.engine import Engine
from paged.core.engine.config import EngineConfig
from paged.core.engine.sampling_params import SamplingParams

LONG = "Tell me a story about a lighthouse keeper and a storm at sea. " * 22  # ~300 tokens
ARRIVALS = (8, 20, 32, 44)


def workload(engine: Engine, streams: int) -> list[tuple[int, int, float]]:
    """(decode rows, prompt rows, forward seconds) of every step."""
    steps = []
    execute = engine.worker.execute

    def timed(out, tables):
        t0 = time.perf_counter()
        result = execute(out, tables)
        prompt = sum(e.num_new_tokens for e in out.prefills)
        steps.append((out.num_tokens - prompt, prompt, time.perf_counter() - t0))
        return result

    engine.worker.execute = timed
    try:
        for i in range(streams):
            engine.add_request(f"s{i}", f"Question {i}: what is {i} + {i}?",
                               SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True))
        n = 0
        while engine.has_unfinished_requests():
            if n in ARRIVALS:
                engine.add_request(f"long{n}", f"{LONG}{n}", SamplingParams(temperature=0.0, max_tokens=8,
                                                                            ignore_eos=True))
            engine.step()
            n += 1
    finally:
        engine.worker.execute = execute
    return steps


def report(label: str, engine: Engine, steps, streams: int) -> None:
    busy = [s for s in steps if s[0] >= streams // 2]
    alone = [t for _, p, t in busy if p == 0]
    mixed = [(p, t) for _, p, t in busy if p > 0]
    print(f"{label}: decode-only steps median {1000 * statistics.median(alone):.1f} ms; "
          f"{len(mixed)} mixed steps, prompt tokens {min(p for p, _ in mixed)}-{max(p for p, _ in mixed)}, "
          f"median {1000 * statistics.median(t for _, t in mixed):.1f} ms, "
          f"max {1000 * max(t for _, t in mixed):.1f} ms")
    budget = engine.scheduler.prefill_budget
    if budget is not None:
        a, c_d, c_p = (1000 * v for v in budget.theta)
        print(f"  learned a {a:.2f} ms, c_d {c_d:.3f} ms, c_p {c_p:.3f} ms; budget beside {streams} decodes: "
              f"{budget.tokens(streams)} tokens")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--itl-target-ms", type=float, default=60.0)
    ap.add_argument("--fixed-cap", type=int, default=128)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--cpu-threads-bind", default=str(min(os.sched_getaffinity(0))),
                    help="default: one core (a shared machine)")
    args = ap.parse_args()
    settings = ((f"itl-target-ms {args.itl_target_ms:g}", dict(itl_target_ms=args.itl_target_ms)),
                (f"fixed cap {args.fixed_cap}", dict(itl_target_ms=None,
                                                     max_prefill_tokens_with_decodes=args.fixed_cap)))
    for label, options in settings:
        engine = Engine(EngineConfig(cpu_threads_bind=args.cpu_threads_bind, max_model_len=1024,
                                     kv_cache_memory="256MiB", enable_prefix_caching=False, **options))
        workload(engine, args.streams)  # warm-up; teaches the cost model
        report(label, engine, workload(engine, args.streams), args.streams)


if __name__ == "__main__":
    main()
