"""Serving side by side: `paged bench serve` against several running servers,
one after another with the same prompts, then one table of output tok/s,
TTFT and TPOT per concurrency level with paged's ratio to each peer.

Start the servers first (README "Performance" and ../shared/PEERS.md say how),
each alone on the machine while it is measured if you can:

    python benchmarks/serving_peers.py --server paged=http://127.0.0.1:8000 \\
        --server vllm=http://127.0.0.1:8011 --server llamacpp=http://127.0.0.1:8765 \\
        [--levels 1,4,16] [--input-len 256] [--output-len 128] [--seed 100] [--json PATH]

NAME=URL uses NAME as the bench backend when it is one (paged, vllm,
llamacpp), else the plain OpenAI dialect; NAME=URL@BACKEND sets it. Text
prompts are used for every server (llama.cpp takes only text); level C sends
max(8, 2*C) prompts built from seed S + C (+ 1000 per repeat; S is --seed,
default 100), so each level starts with a cold prefix cache and every server
gets the same words. Servers that stay up across runs keep what they cached:
a second run with the same --seed (or a longer --input-len whose prompts
start with the same words) is answered from their prefix caches and
measures little prefill; give each run on the same servers its own --seed
(for example 100, 5100, 10100), or restart the servers.

`--repeat N` pairs the measurements in time, for a shared host whose speed
drifts by more than the differences measured: N rounds, each running every
level on every server back to back (level by level, the servers' order
rotated each round), then each level's median over the rounds per server
and the median of the per-round ratios. All servers stay up for the whole
run, so each must idle quietly while another is measured.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys

from paged.core.bench import serve as bench_serve
from timing import emit_json


def parse_server(text: str) -> tuple[str, str, str]:
    name, sep, url = text.partition("=")
    if not sep or not name or not url.startswith("http"):
        raise argparse.ArgumentTypeError(f"--server wants NAME=http://HOST:PORT[@BACKEND], got {text!r}")
    url, _, backend = url.partition("@")
    backend = backend or (name if name in bench_serve.BACKENDS else "openai")
    if backend not in bench_serve.BACKENDS:
        raise argparse.ArgumentTypeError(f"backend {backend!r} is not one of {', '.join(bench_serve.BACKENDS)}")
    return name, url, backend


def bench_argv(url: str, backend: str, level: int, args, round_: int = 0) -> list[str]:
    """`paged bench serve`'s arguments for one level of one round."""
    return ["--base-url", url, "--backend", backend, "--text-prompts", "--ignore-eos",
            "--num-prompts", str(max(8, 2 * level)), "--input-len", str(args.input_len),
            "--output-len", str(args.output_len), "--max-concurrency", str(level),
            "--seed", str(args.seed + level + 1000 * round_)]


def measure(url: str, backend: str, level: int, args, round_: int = 0) -> dict:
    p = argparse.ArgumentParser()
    bench_serve.add_arguments(p)
    report = asyncio.run(bench_serve.benchmark(p.parse_args(bench_argv(url, backend, level, args, round_))))
    return report["levels"][0]


def schedule(servers, levels: list[int], repeat: int):
    """(round, level, server) in measuring order: with one round each
    server's levels in turn; with more, level by level with every server back
    to back, the servers' order rotated by one each round."""
    if repeat == 1:
        return [(0, level, srv) for srv in servers for level in levels]
    order = []
    for r in range(repeat):
        rotated = servers[r % len(servers):] + servers[:r % len(servers)]
        order += [(r, level, srv) for level in levels for srv in rotated]
    return order


def median_run(rs: list) -> dict | None:
    """The run with the median output tok/s (the lower middle one of an even
    count) among those that did not fail; None when all failed."""
    ok = sorted((r for r in rs if r), key=lambda r: r["output_throughput"])
    return ok[(len(ok) - 1) // 2] if ok else None


def round_ratios(a: list, b: list) -> list[float]:
    """Output tok/s of a over b, round by round, where both ran."""
    return [x["output_throughput"] / y["output_throughput"] for x, y in zip(a, b)
            if x and y and y["output_throughput"] > 0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--server", type=parse_server, action="append", required=True, metavar="NAME=URL[@BACKEND]")
    ap.add_argument("--levels", default="1,4,16", help="concurrency levels, comma separated")
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=1, metavar="N",
                    help="rounds of every level on every server back to back, servers rotated each round "
                         "(default 1: each server's levels in turn)")
    ap.add_argument("--seed", type=int, default=100, metavar="S",
                    help="prompts of level C, round r from seed S + C + 1000 r (default 100); another S for "
                         "another run on servers that stay up")
    ap.add_argument("--json", default=None, metavar="PATH")
    args = ap.parse_args()
    try:
        levels = bench_serve._levels(args.levels)
    except ValueError as exc:
        print(f"serving_peers: {exc}", file=sys.stderr)
        return 2
    if args.repeat < 1:
        print(f"serving_peers: --repeat must be >= 1, got {args.repeat}", file=sys.stderr)
        return 2

    runs = {name: {level: [] for level in levels} for name, _, _ in args.server}  # per round, None: failed
    for r, level, (name, url, backend) in schedule(args.server, levels, args.repeat):
        print(f"{name} ({backend}, {url}): concurrency {level}"
              + (f", round {r + 1}/{args.repeat}" if args.repeat > 1 else "") + " ...", file=sys.stderr, flush=True)
        try:
            runs[name][level].append(measure(url, backend, level, args, r))
        except Exception as exc:  # a peer that fails is reported, the others still run
            runs[name][level].append(None)
            print(f"serving_peers: {name} at concurrency {level}: {exc}", file=sys.stderr)
    medians = {name: {level: median_run(rs) for level, rs in by_level.items()} for name, by_level in runs.items()}
    results = {name: {level: run for level, run in by_level.items() if run} for name, by_level in medians.items()}

    names = [s[0] for s in args.server]
    print(f"{args.input_len}-token text prompts -> {args.output_len} tokens (EOS suppressed); "
          "out tok/s | TTFT p50 s | TPOT p50 ms")
    print(f"{'C':>3} " + "".join(f"{n:>30}" for n in names))
    for level in levels:
        cells = []
        for n in names:
            L = results[n].get(level)
            cells.append("failed" if L is None else
                         f"{L['output_throughput']:.1f} | {L['ttft_ms']['p50'] / 1e3:.2f} | {L['tpot_ms']['p50']:.1f}")
        print(f"{level:>3} " + "".join(f"{c:>30}" for c in cells))
    first = names[0]
    ratios: dict[str, dict[str, list[float]]] = {}
    for n in names[1:]:
        ratios[n] = {}
        for level in levels:
            a, b = results[first].get(level), results[n].get(level)
            paired = round_ratios(runs[first][level], runs[n][level])
            ratios[n][str(level)] = paired
            if not (a and b and b["output_throughput"] > 0):
                continue
            ttft = f"TTFT p50 {a['ttft_ms']['p50'] / 1e3:.2f} s vs {b['ttft_ms']['p50'] / 1e3:.2f} s"
            if len(paired) > 1:  # the paired figure leads: the median runs may come from different rounds
                print(f"C={level}: {first} / {n} output tok/s, median of rounds {statistics.median(paired):.2f}x ("
                      + " / ".join(f"{x:.2f}" for x in paired) + f"); median runs' {ttft}")
            else:
                print(f"C={level}: {first} / {n} output tok/s = {a['output_throughput'] / b['output_throughput']:.2f}x"
                      f", {ttft}")
    report = {"input_len": args.input_len, "output_len": args.output_len, "repeat": args.repeat, "seed": args.seed,
              "servers": {n: {"url": u, "backend": b} for n, u, b in args.server},
              "results": {n: {str(k): v for k, v in r.items()} for n, r in results.items()},
              "runs": {n: {str(k): v for k, v in r.items()} for n, r in runs.items()},
              "round_ratios": ratios}
    emit_json(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
