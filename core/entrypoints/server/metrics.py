"""Server metrics in the Prometheus text exposition format.

Written by hand (a few counters, gauges and histograms) so serving does not
depend on prometheus_client; the tests parse the output with its parser.
Latencies are recorded by the AsyncEngine (it calls the on_* hooks on the
event-loop thread); engine gauges come from the engine's stats snapshot.
The hooks also feed the web page's history (server/live.py).
"""

from __future__ import annotations

import math
import threading
from typing import Iterable, Optional

from paged.core.entrypoints.server.live import LiveHistory

PREFIX = "paged:"

# seconds; wide enough for a CPU serving a 7B model and a GPU serving a 135M one
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


class Histogram:
    def __init__(self, name: str, help_text: str, buckets: Iterable[float]):
        self.name, self.help = name, help_text
        self.buckets = tuple(sorted(buckets))
        self.counts = [0] * len(self.buckets)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        for i, upper in enumerate(self.buckets):
            if value <= upper:
                self.counts[i] += 1
        self.sum += value
        self.count += 1

    def render(self, labels: str) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        for upper, n in zip(self.buckets, self.counts):
            lines.append(f'{self.name}_bucket{{{labels},le="{upper}"}} {n}')
        lines.append(f'{self.name}_bucket{{{labels},le="+Inf"}} {self.count}')
        lines.append(f"{self.name}_sum{{{labels}}} {_num(self.sum)}")
        lines.append(f"{self.name}_count{{{labels}}} {self.count}")
        return lines


def _num(v: float) -> str:
    if isinstance(v, float) and (math.isnan(v) or math.isinf(v)):
        return "NaN" if math.isnan(v) else ("+Inf" if v > 0 else "-Inf")
    return repr(float(v))


def _pick(stats: dict, *keys, default=0.0):
    """First present key: the engine's stats() names are not fixed across versions."""
    for k in keys:
        if k in stats and stats[k] is not None:
            return stats[k]
    return default


class ServerMetrics:
    def __init__(self, model_name: str):
        self.labels = f'model_name="{_escape(model_name)}"'
        self._lock = threading.Lock()
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.requests_finished = 0
        self.requests_rejected = 0  # 503s: queue full or shutting down
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.tpot = Histogram(
            PREFIX + "time_per_output_token_seconds", "Mean time per output token after the first.", TPOT_BUCKETS
        )
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "End-to-end request latency.", E2E_BUCKETS)
        self.live = LiveHistory()

    # -- hooks called by AsyncEngine ---------------------------------------
    def on_first_token(self, ttft: float) -> None:
        with self._lock:
            self.ttft.observe(ttft)
        self.live.on_first_token(ttft)

    def on_tokens(self, n: int) -> None:
        with self._lock:
            self.generation_tokens += n
        self.live.on_tokens(n)

    def on_finish(self, prompt_tokens: int, output_tokens: int, e2e: float, ttft: float, request_id: str = "",
                  finish_reason: Optional[str] = None) -> None:
        with self._lock:
            self.prompt_tokens += prompt_tokens
            self.requests_finished += 1
            self.e2e.observe(e2e)
            if output_tokens > 1:
                self.tpot.observe((e2e - ttft) / (output_tokens - 1))
        self.live.on_finish(request_id, prompt_tokens, output_tokens, e2e, ttft, finish_reason)

    def on_rejected(self) -> None:
        with self._lock:
            self.requests_rejected += 1

    def totals(self) -> dict:
        """The server's counters, for the web page's state."""
        with self._lock:
            return {"finished": self.requests_finished, "rejected": self.requests_rejected,
                    "prompt_tokens": self.prompt_tokens, "generation_tokens": self.generation_tokens}

    # -- exposition ----------------------------------------------------------
    def render(self, engine_stats: dict, num_in_flight: int) -> str:
        L = self.labels
        s = engine_stats or {}
        kv = s.get("kv_cache") if isinstance(s.get("kv_cache"), dict) else s
        usage = float(_pick(kv, "kv_cache_usage", "usage", "kv_usage", default=0.0))
        gauges = [
            ("num_requests_running", "Requests in the running batch.",
             _pick(s, "num_running", "running", default=num_in_flight)),
            ("num_requests_waiting", "Requests waiting to be scheduled.", _pick(s, "num_waiting", "waiting")),
            ("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0..1).", usage),
            ("kv_cache_blocks_total", "KV cache blocks.", _pick(kv, "num_blocks", "total_blocks")),
            ("kv_cache_blocks_used", "KV cache blocks referenced by requests.", _pick(kv, "used", "used_blocks")),
            ("prefix_cache_hit_rate", "Prefix-cache hit rate over lookups (0..1).",
             _pick(kv, "hit_rate", "prefix_cache_hit_rate")),
        ]
        counters = [
            ("num_preemptions", "Requests preempted (recompute) for lack of KV blocks.",
             _pick(s, "num_preemptions", "preemptions")),
            ("prompt_tokens", "Prompt tokens processed.", self.prompt_tokens),
            ("generation_tokens", "Tokens generated.", self.generation_tokens),
            ("request_success", "Requests finished.", self.requests_finished),
            ("request_rejected", "Requests refused with 503 (queue full or shutting down).", self.requests_rejected),
        ]
        if "prefill_budget_tokens" in s:  # --itl-target-ms on (core/engine/prefill_budget.py)
            gauges += [
                ("prefill_budget_tokens", "Prompt tokens the latest step with decodes could carry.",
                 _pick(s, "prefill_budget_tokens", default=float("nan"))),
                ("prefill_token_cost_seconds", "Learned seconds one prompt token adds to a step (NaN: "
                 "still learning).", _pick(s, "prefill_token_cost_s", default=float("nan"))),
            ]
        if "spec_decode_num_drafts" in s:  # speculative decoding on (core/engine/spec_decode.py)
            gauges += [
                ("spec_decode_acceptance_rate", "Draft tokens accepted over draft tokens proposed (0..1).",
                 s["spec_decode_acceptance_rate"]),
                ("spec_decode_tokens_per_step", "Mean tokens a decoding sequence emits per step (1 without "
                 "speculation).", s["spec_decode_tokens_per_step"]),
            ]
            counters += [
                ("spec_decode_num_drafts", "Steps that verified drafts for a sequence.", s["spec_decode_num_drafts"]),
                ("spec_decode_num_draft_tokens", "Draft tokens proposed.", s["spec_decode_num_draft_tokens"]),
                ("spec_decode_num_accepted_tokens", "Draft tokens accepted.", s["spec_decode_num_accepted_tokens"]),
            ]
        lines: list[str] = []
        for name, help_text, value in gauges:
            full = PREFIX + name
            lines += [f"# HELP {full} {help_text}", f"# TYPE {full} gauge", f"{full}{{{L}}} {_num(float(value))}"]
        for name, help_text, value in counters:
            full = PREFIX + name
            lines += [f"# HELP {full} {help_text}", f"# TYPE {full} counter",
                      f"{full}_total{{{L}}} {_num(float(value))}"]
        with self._lock:
            for h in (self.ttft, self.tpot, self.e2e):
                lines += h.render(L)
        return "\n".join(lines) + "\n"


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
