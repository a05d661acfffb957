"""Serving benchmark against any OpenAI-compatible server (paged, vLLM,
llama.cpp): streaming completions of random prompts of exact token length.

    paged bench serve --base-url http://127.0.0.1:8000 --model NAME \
        --num-prompts 64 --input-len 256 --output-len 128 --max-concurrency 1,4,16 --ignore-eos

Several concurrency levels run one after another in the same invocation and
print side by side. Per request: TTFT (send -> first content chunk), ITL
(gaps between content chunks), TPOT ((e2e - TTFT) / (output tokens - 1)),
e2e. Output tokens come from the final usage chunk when the server sends it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Optional

import httpx

BACKENDS = ("paged", "vllm", "llamacpp", "openai")

# words that are one token (with their leading space) in common BPE vocabularies
_WORDS = ("the of and to in is was for on as with by at from his her they this that had not are but "
          "which have one were all been their has when who will more there can an would so what said "
          "some time these two may first then do any like my now over such our man me even most made "
          "after also did many before must through back years where much your way well down should "
          "because each just those people how too little state good very make world still own see men "
          "work long get here between both life being under never day same another know while last").split()


@dataclass
class RequestResult:
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    output_tokens: int = 0
    itl: list[float] = field(default_factory=list)
    error: str = ""


def _in_range(low: float, high: float, low_open: bool = False):
    """argparse type: a float in [low, high] ((low, high] with low_open), else
    a usage error (argparse names the flag) naming the value."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = float("nan")
        if not (value > low if low_open else value >= low) or not value <= high:
            raise argparse.ArgumentTypeError(f"expected a number in {'(' if low_open else '['}{low}, {high}], "
                                             f"got {text!r}")
        return value
    return parse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (without /v1)")
    p.add_argument("--model", default=None, help="model name to send (default: the server's first /v1/models id)")
    p.add_argument("--backend", choices=BACKENDS, default="paged",
                   help="server flavour: how to ask it to ignore EOS (paged/vllm: ignore_eos; llamacpp: "
                        "logit_bias on the EOS id and repeat_penalty 1; openai: nothing)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=256, help="prompt length in tokens")
    p.add_argument("--output-len", type=int, default=128, help="max_tokens per request")
    p.add_argument("--max-concurrency", default="16",
                   help="requests in flight at most; a comma list (1,4,16) runs each level in turn")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="Poisson arrival rate in requests/s (default: inf, all at once)")
    p.add_argument("--text-prompts", action="store_true",
                   help="send text that the server's /tokenize counts as --input-len tokens instead of token ids")
    p.add_argument("--ignore-eos", action="store_true", help="generate exactly --output-len tokens")
    p.add_argument("--eos-token-id", type=int, default=2, help="EOS id biased away for --backend llamacpp")
    p.add_argument("--vocab-range", default="1000,10000",
                   help="token ids of random token prompts are drawn from [lo, hi) (default: 1000,10000)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--temperature", type=_in_range(0.0, float("inf")), default=0.0,
                   help="sampling temperature of every request (default 0: greedy)")
    p.add_argument("--top-p", type=_in_range(0.0, 1.0, low_open=True), default=1.0,
                   help="top_p of every request, in (0, 1] (default 1: off)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON here")


# -- prompts ---------------------------------------------------------------


def token_prompts(n: int, length: int, lo: int, hi: int, rng: random.Random) -> list[list[int]]:
    return [[rng.randrange(lo, hi) for _ in range(length)] for _ in range(n)]


async def count_tokens(client: httpx.AsyncClient, backend: str, model: str, text: str) -> int:
    """Tokens the server counts in ``text``: /tokenize (paged, vLLM, llama.cpp's
    llama-server), else llama-cpp-python's /extras/tokenize/count."""
    body = {"content": text} if backend == "llamacpp" else {"model": model, "prompt": text}
    r = await client.post("/tokenize", json=body)
    if r.status_code == 404:
        r = await client.post("/extras/tokenize/count", json={"input": text, "model": model})
    r.raise_for_status()
    data = r.json()
    return data["count"] if "count" in data else len(data["tokens"])


async def text_prompt(client, backend, model, length: int, rng: random.Random) -> str:
    """Random words, grown or trimmed until the server counts exactly `length` tokens."""
    words = [rng.choice(_WORDS) for _ in range(length)]
    for _ in range(50):
        n = await count_tokens(client, backend, model, " ".join(words))
        if n == length:
            return " ".join(words)
        per_word = max(1.0, n / max(1, len(words)))
        step = max(1, int(abs(n - length) / per_word))
        if n > length:
            del words[max(1, len(words) - step):]
        else:
            words += [rng.choice(_WORDS) for _ in range(step)]
    raise RuntimeError(f"could not build a text prompt of exactly {length} tokens")


# -- one request -----------------------------------------------------------


def request_body(args, model: str, prompt) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": args.output_len, "temperature": args.temperature,
            "stream": True, "stream_options": {"include_usage": True}}
    if args.top_p < 1.0:
        body["top_p"] = args.top_p
    if args.ignore_eos:
        if args.backend in ("paged", "vllm"):
            body["ignore_eos"] = True
        elif args.backend == "llamacpp":
            body["logit_bias"] = {str(args.eos_token_id): -100}
            body["repeat_penalty"] = 1.0
    return body


async def one_request(client: httpx.AsyncClient, body: dict) -> RequestResult:
    start = time.perf_counter()
    last = None
    ttft = 0.0
    chunks = 0
    usage_tokens = None
    itl: list[float] = []
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")
                return RequestResult(False, error=f"HTTP {r.status_code}: {text[:200]}")
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                msg = json.loads(data)
                if "error" in msg:
                    return RequestResult(False, error=str(msg["error"])[:200])
                if msg.get("usage"):
                    usage_tokens = msg["usage"].get("completion_tokens")
                if any(c.get("text") for c in msg.get("choices") or ()):
                    now = time.perf_counter()
                    if last is None:
                        ttft = now - start
                    else:
                        itl.append(now - last)
                    last = now
                    chunks += 1
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        return RequestResult(False, error=f"{type(exc).__name__}: {exc}")
    e2e = time.perf_counter() - start
    return RequestResult(True, ttft, e2e, usage_tokens if usage_tokens is not None else chunks, itl)


# -- one level ---------------------------------------------------------------


def _stats_ms(values: list[float]) -> dict:
    if not values:
        return {"mean": None, "p50": None, "p99": None}
    ordered = sorted(values)

    def pct(q):
        return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]

    return {"mean": 1e3 * statistics.fmean(values), "p50": 1e3 * pct(0.50), "p99": 1e3 * pct(0.99)}


async def run_level(client, args, model, prompts, concurrency: int) -> dict:
    rng = random.Random(args.seed)
    gate = asyncio.Semaphore(concurrency)

    async def limited(prompt):
        async with gate:
            return await one_request(client, request_body(args, model, prompt))

    tasks = []
    start = time.perf_counter()
    for prompt in prompts:
        tasks.append(asyncio.create_task(limited(prompt)))
        if args.request_rate != float("inf"):
            await asyncio.sleep(rng.expovariate(args.request_rate))
    results = await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return {
        "max_concurrency": concurrency,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (out_tokens + len(ok) * args.input_len) / duration,
        "total_output_tokens": out_tokens,
        "ttft_ms": _stats_ms([r.ttft for r in ok]),
        "tpot_ms": _stats_ms(tpot),
        "itl_ms": _stats_ms([x for r in ok for x in r.itl]),
        "e2e_ms": _stats_ms([r.e2e for r in ok]),
    }


def _levels(text: str) -> list[int]:
    try:
        levels = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        levels = []
    if not levels or any(c < 1 for c in levels):
        raise ValueError(f"--max-concurrency must be positive integers separated by commas, got {text!r}")
    return levels


def _check(args) -> None:
    for name in ("num_prompts", "input_len", "output_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not args.request_rate > 0:
        raise ValueError(f"--request-rate must be > 0, got {args.request_rate}")
    lo, hi = (int(x) for x in args.vocab_range.split(","))
    if not 0 <= lo < hi:
        raise ValueError(f"--vocab-range must be lo,hi with 0 <= lo < hi, got {args.vocab_range!r}")


async def benchmark(args) -> dict:
    _check(args)
    levels = _levels(args.max_concurrency)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=max(levels) + 4, max_keepalive_connections=max(levels) + 4)
    async with httpx.AsyncClient(base_url=args.base_url.rstrip("/"), headers=headers, limits=limits,
                                 timeout=httpx.Timeout(None, connect=10.0)) as client:
        model = args.model
        if model is None:
            r = await client.get("/v1/models")
            r.raise_for_status()
            model = r.json()["data"][0]["id"]
        rng = random.Random(args.seed)
        if args.text_prompts:
            prompts = [await text_prompt(client, args.backend, model, args.input_len, rng)
                       for _ in range(args.num_prompts)]
        else:
            lo, hi = (int(x) for x in args.vocab_range.split(","))
            prompts = token_prompts(args.num_prompts, args.input_len, lo, hi, rng)
        warm = await one_request(client, {**request_body(args, model, prompts[0]), "max_tokens": 4})
        if not warm.ok:
            raise RuntimeError(f"warm-up request failed: {warm.error}")
        results = [await run_level(client, args, model, prompts, c) for c in levels]
    return {"backend": args.backend, "base_url": args.base_url, "model": model, "num_prompts": args.num_prompts,
            "input_len": args.input_len, "output_len": args.output_len,
            "request_rate": None if args.request_rate == float("inf") else args.request_rate,
            "ignore_eos": args.ignore_eos, "text_prompts": args.text_prompts, "levels": results}


def format_table(report: dict) -> str:
    rows = [("concurrency", lambda L: f"{L['max_concurrency']}"),
            ("completed / failed", lambda L: f"{L['completed']} / {L['failed']}"),
            ("duration (s)", lambda L: f"{L['duration_s']:.2f}"),
            ("requests/s", lambda L: f"{L['request_throughput']:.2f}"),
            ("output tok/s", lambda L: f"{L['output_throughput']:.1f}"),
            ("total tok/s", lambda L: f"{L['total_token_throughput']:.1f}")]
    for key, label in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E")):
        for stat in ("mean", "p50", "p99"):
            rows.append((f"{label} {stat} (ms)",
                         lambda L, k=key, s=stat: "-" if L[k][s] is None else f"{L[k][s]:.1f}"))
    head = (f"backend {report['backend']}  model {report['model']}  prompts {report['num_prompts']} x "
            f"{report['input_len']} tokens -> {report['output_len']} tokens  rate {report['request_rate'] or 'inf'}")
    lines = [head]
    for label, fmt in rows:
        lines.append(f"{label:<20}" + "".join(f"{fmt(L):>14}" for L in report["levels"]))
    for L in report["levels"]:
        for err in L["errors"]:
            lines.append(f"error at concurrency {L['max_concurrency']}: {err}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    try:
        report = asyncio.run(benchmark(args))
    except (ValueError, RuntimeError, httpx.HTTPError) as exc:
        print(f"paged bench serve: {exc}", file=sys.stderr)
        return 2
    print(format_table(report))
    print(json.dumps(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if all(L["failed"] == 0 for L in report["levels"]) else 1


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="paged bench serve")
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
