"""The engine's live state for the web page: GET /v1/engine/state.

    history = LiveHistory()                  # fed by ServerMetrics' hooks
    state = history.state(aengine.stats(), aengine.num_in_flight, config)

Built from what the engine already counts (its stats snapshot: requests
running and waiting, KV blocks, prefix-cache lookups) and from the latency
hooks the AsyncEngine calls on the event-loop thread (first token, tokens,
finish). The history covers the last WINDOW_S seconds: output tokens per
second in one-second bins, each request's time to first token and mean
inter-token latency when it finishes, and the last RECENT requests with
their timings. Nothing here is sampled on a timer: a server nobody watches
does no extra work.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from typing import Callable, Optional

from pydantic import BaseModel, ConfigDict

#: seconds of history the page plots
WINDOW_S = 300
#: finished requests listed
RECENT = 50


class FinishedRequest(BaseModel):
    model_config = ConfigDict(frozen=True)

    id: str
    finished_at: float  # unix seconds
    prompt_tokens: int
    output_tokens: int
    ttft_s: float
    itl_s: Optional[float]  # mean time between output tokens after the first; None for one token
    e2e_s: float
    finish_reason: Optional[str]


class RequestCounts(BaseModel):
    running: int
    waiting: int
    in_flight: int  # requests the API holds, including those still compiling a constraint
    preemptions: int
    finished: int
    rejected: int  # 503s: waiting queue full, or shutting down
    prompt_tokens: int
    generation_tokens: int


class KVCacheState(BaseModel):
    blocks_total: int
    blocks_used: int
    blocks_free: int
    blocks_cached: int  # free blocks still holding a cached prefix
    usage: float
    prefix_queries: int
    prefix_hits: int
    prefix_hit_rate: float


class History(BaseModel):
    window_s: int
    start: int  # unix second of output_tokens_per_s[0]
    output_tokens_per_s: list[int]
    ttft_s: list[tuple[float, float]]  # (unix time, seconds to first token)
    itl_s: list[tuple[float, float]]  # (unix time finished, mean inter-token seconds)


class EngineState(BaseModel):
    """GET /v1/engine/state."""

    model: str
    max_model_len: int
    time: float
    requests: RequestCounts
    kv_cache: KVCacheState
    spec_decode: Optional[dict[str, float]]
    history: History
    recent: list[FinishedRequest]  # newest first


class LiveHistory:
    def __init__(self, window_s: int = WINDOW_S, clock: Callable[[], float] = time.time):
        self.window_s = window_s
        self._clock = clock
        self._lock = threading.Lock()
        self._token_bins: deque[list] = deque()  # [whole second, output tokens in it], oldest first
        self._ttft: deque[tuple[float, float]] = deque()  # (unix time, seconds)
        self._itl: deque[tuple[float, float]] = deque()  # (unix time finished, mean seconds)
        self._recent: deque[FinishedRequest] = deque(maxlen=RECENT)

    # -- hooks (ServerMetrics forwards the AsyncEngine's) -----------------------------
    def on_first_token(self, ttft: float) -> None:
        with self._lock:
            self._ttft.append((self._clock(), ttft))

    def on_tokens(self, n: int) -> None:
        second = math.floor(self._clock())
        with self._lock:
            if self._token_bins and self._token_bins[-1][0] == second:
                self._token_bins[-1][1] += n
            else:
                self._token_bins.append([second, n])

    def on_finish(self, request_id: str, prompt_tokens: int, output_tokens: int, e2e: float, ttft: float,
                  finish_reason: Optional[str]) -> None:
        itl = (e2e - ttft) / (output_tokens - 1) if output_tokens > 1 else None
        now = self._clock()
        with self._lock:
            self._recent.append(FinishedRequest(
                id=request_id, finished_at=now, prompt_tokens=prompt_tokens, output_tokens=output_tokens,
                ttft_s=ttft, itl_s=itl, e2e_s=e2e, finish_reason=finish_reason))
            if itl is not None:
                self._itl.append((now, itl))

    # -- the endpoint's answer -------------------------------------------------------
    def state(self, stats: dict, num_in_flight: int, model: str, max_model_len: int, counters: dict) -> dict:
        """The JSON of GET /v1/engine/state (stats: the engine's snapshot;
        counters: the server's totals, ServerMetrics.totals())."""
        kv = stats.get("kv_cache") or {}
        now = self._clock()
        return {
            "model": model,
            "max_model_len": max_model_len,
            "time": now,
            "requests": {"running": stats.get("num_running", 0), "waiting": stats.get("num_waiting", 0),
                         "in_flight": num_in_flight, "preemptions": stats.get("num_preemptions", 0), **counters},
            "kv_cache": {"blocks_total": kv.get("num_blocks", 0), "blocks_used": kv.get("used", 0),
                         "blocks_free": kv.get("free", 0), "blocks_cached": kv.get("cached", 0),
                         "usage": kv.get("usage", 0.0), "prefix_queries": kv.get("prefix_queries", 0),
                         "prefix_hits": kv.get("prefix_hits", 0), "prefix_hit_rate": kv.get("hit_rate", 0.0)},
            "spec_decode": {k.removeprefix("spec_decode_"): v for k, v in stats.items()
                            if k.startswith("spec_decode_")} or None,
            "history": self._history(now),
            "recent": self._recent_list(),
        }

    def _history(self, now: float) -> dict:
        end = math.floor(now)
        start = end - self.window_s + 1
        with self._lock:
            while self._token_bins and self._token_bins[0][0] < start:
                self._token_bins.popleft()
            for points in (self._ttft, self._itl):
                while points and points[0][0] < now - self.window_s:
                    points.popleft()
            tokens = [0] * self.window_s
            for second, n in self._token_bins:
                if second <= end:
                    tokens[second - start] += n
            ttft, itl = [list(p) for p in self._ttft], [list(p) for p in self._itl]
        return {"window_s": self.window_s, "start": start, "output_tokens_per_s": tokens, "ttft_s": ttft,
                "itl_s": itl}

    def _recent_list(self) -> list[dict]:
        with self._lock:
            return [r.model_dump() for r in reversed(self._recent)]  # newest first
