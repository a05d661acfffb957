"""Cost of structured output: engine steps of constrained decoding against
the same steps unconstrained, at 1 and 16 streams, with the real default
model and real llguidance.

    python benchmarks/structured_outputs.py [--streams 1 16] [--steps 24] [--rounds 3]
                                            [--device cpu] [--threads-bind auto] [--json PATH]

Workload: every stream decodes greedily; the constrained ones follow a JSON
Lines grammar (one object per line, each matching a small schema: integer,
bounded strings, a short array), written as Lark with llguidance's %json, so
the grammar never ends and every step masks. EOS is biased by -100 in both
modes so no stream stops; the modes differ only in the constraint.

Columns (milliseconds):
  step free / step json   one engine.step() with every stream decoding: the
                          best and the median of --steps x --rounds steps
                          (modes interleaved round by round; the best is the
                          figure least distorted by other processes)
  overhead                json / free - 1, on the best and on the median
  grammar                 the grammar's own work per step, timed apart from
                          the model: sampler with masks - sampler without,
                          plus advancing every matcher by one token
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from timing import best_time, emit_json

from paged.core.engine.engine import Engine
from paged.core.engine.config import EngineConfig
from paged.core.engine.request import Request
from paged.core.engine.sampling_params import SamplingParams, StructuredOutputsParams
from paged.core.engine.structured.params import JSON_LAYOUT

ROW = {"type": "object", "properties": {
    "id": {"type": "integer"},
    "name": {"type": "string", "maxLength": 16},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3}},
    "required": ["id", "name", "tags"], "additionalProperties": False, "x-guidance": JSON_LAYOUT}
JSON_LINES = f'start: line+\nline: row "\\n"\nrow: %json {json.dumps(ROW)}'
PROMPTS = ["Users of the system, one JSON object per line:", "Inventory rows as JSON lines:",
           "Here are the records:", "A log of events, as JSON:"]


def params(engine: Engine, max_tokens: int, constrained: bool) -> SamplingParams:
    no_eos = {t: -100.0 for t in engine.stop_token_ids}
    so = StructuredOutputsParams(grammar=JSON_LINES) if constrained else None
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logit_bias=no_eos,
                          structured_outputs=so)


def timed_steps(engine: Engine, streams: int, steps: int, constrained: bool) -> list[float]:
    """Seconds per engine.step() while all `streams` decode."""
    p = params(engine, steps + 8, constrained)
    ids = [f"bench-{constrained}-{i}" for i in range(streams)]
    for i, rid in enumerate(ids):
        engine.add_request(rid, PROMPTS[i % len(PROMPTS)] + f" (batch {i})", p)
    reqs = [engine.scheduler.requests.get(rid) for rid in ids]
    while not all(r is not None and r.seqs[0].num_output_tokens >= 2 for r in reqs):
        engine.step()  # prefill (and the grammar compile on first use)
        reqs = [engine.scheduler.requests.get(rid) for rid in ids]
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    for rid in ids:
        engine.abort_request(rid)
    return times


def grammar_work(engine: Engine, streams: int, min_time: float) -> float:
    """Seconds of grammar work per step for `streams` rows, apart from the
    model: the sampler with masks minus without, plus one token consumed
    (and rolled back) per matcher."""
    template = engine.grammars.compiler.compile(StructuredOutputsParams(grammar=JSON_LINES))
    prefix = engine.tokenizer.encode('{"id": 12, "name": "Ada Lov', add_special_tokens=False)
    free_p, json_p = params(engine, 64, False), params(engine, 64, True)
    free = [Request(f"f{i}", None, [1, 2], free_p).seqs[0] for i in range(streams)]
    constrained = [Request(f"c{i}", None, [1, 2], json_p).seqs[0] for i in range(streams)]
    for s in constrained:
        s.matcher = template.deep_copy()
        assert s.matcher.consume_tokens(prefix)
    logits = torch.randn(streams, engine.model_config.vocab_size)
    nxt = engine.tokenizer.encode("e", add_special_tokens=False)[0]

    def consume_all():
        for s in constrained:
            s.matcher.consume_token(nxt)
            s.matcher.rollback(1)

    t_free = best_time(lambda: engine.sampler(logits, free), min_time)
    t_json = best_time(lambda: engine.sampler(logits, constrained), min_time)
    return t_json - t_free + best_time(consume_all, min_time)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads-bind", default="auto")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    engine = Engine(EngineConfig(device=args.device, dtype="float32", max_model_len=1024,
                                 max_num_seqs=max(args.streams), kv_cache_memory="256MiB",
                                 cpu_threads_bind=args.threads_bind))
    rows = []
    for streams in args.streams:
        timed_steps(engine, streams, 4, True)  # warm: compile, the executor's threads, caches
        free, constrained = [], []
        for _ in range(args.rounds):
            free += timed_steps(engine, streams, args.steps, False)
            constrained += timed_steps(engine, streams, args.steps, True)
        rows.append(summary(streams, free, constrained, grammar_work(engine, streams, 1.0)))
    print_table(rows)
    emit_json({"benchmark": "structured_outputs", "device": args.device, "rows": rows}, args.json)


def summary(streams: int, free: list[float], constrained: list[float], grammar: float) -> dict:
    ms = lambda x: round(1e3 * x, 3)  # noqa: E731
    best_f, best_c = min(free), min(constrained)
    med_f, med_c = statistics.median(free), statistics.median(constrained)
    return {"streams": streams, "free_best_ms": ms(best_f), "json_best_ms": ms(best_c),
            "free_median_ms": ms(med_f), "json_median_ms": ms(med_c),
            "overhead_best_pct": round(100 * (best_c / best_f - 1), 1),
            "overhead_median_pct": round(100 * (med_c / med_f - 1), 1),
            "grammar_ms": ms(grammar), "grammar_pct_of_free_step": round(100 * grammar / best_f, 1)}


def print_table(rows: list[dict]) -> None:
    print(f"{'streams':>7} {'step free':>18} {'step json':>18} {'overhead':>15} {'grammar':>16}")
    print(f"{'':>7} {'best / median ms':>18} {'best / median ms':>18} {'best / median':>15} {'ms (% of step)':>16}")
    for r in rows:
        print(f"{r['streams']:>7} {r['free_best_ms']:>8.2f} / {r['free_median_ms']:>7.2f} "
              f"{r['json_best_ms']:>8.2f} / {r['json_median_ms']:>7.2f} "
              f"{r['overhead_best_pct']:>+6.1f}% / {r['overhead_median_pct']:>+5.1f}% "
              f"{r['grammar_ms']:>7.3f} ({r['grammar_pct_of_free_step']:.1f}%)")


if __name__ == "__main__":
    main()
