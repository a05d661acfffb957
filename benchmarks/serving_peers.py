"""Serving side by side: `paged bench serve` against several running servers,
one after another with the same prompts, then one table of output tok/s,
TTFT and TPOT per concurrency level with paged's ratio to each peer.

Start the servers first (README "Performance" and ../shared/PEERS.md say how),
each alone on the machine while it is measured if you can:

    python benchmarks/serving_peers.py --server paged=http://127.0.0.1:8000 \\
        --server vllm=http://127.0.0.1:8011 --server llamacpp=http://127.0.0.1:8765 \\
        [--levels 1,4,16] [--input-len 256] [--output-len 128] [--json PATH]

NAME=URL uses NAME as the bench backend when it is one (paged, vllm,
llamacpp), else the plain OpenAI dialect; NAME=URL@BACKEND sets it. Text
prompts are used for every server (llama.cpp takes only text); level C sends
max(8, 2*C) prompts built from seed 100 + C, so each level starts with a cold
prefix cache and every server gets the same words.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from paged.core import bench_serve
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


def measure(url: str, backend: str, level: int, args) -> dict:
    p = argparse.ArgumentParser()
    bench_serve.add_arguments(p)
    argv = ["--base-url", url, "--backend", backend, "--text-prompts", "--ignore-eos",
            "--num-prompts", str(max(8, 2 * level)), "--input-len", str(args.input_len),
            "--output-len", str(args.output_len), "--max-concurrency", str(level), "--seed", str(100 + level)]
    report = asyncio.run(bench_serve.benchmark(p.parse_args(argv)))
    return report["levels"][0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--server", type=parse_server, action="append", required=True, metavar="NAME=URL[@BACKEND]")
    ap.add_argument("--levels", default="1,4,16", help="concurrency levels, comma separated")
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--json", default=None, metavar="PATH")
    args = ap.parse_args()
    try:
        levels = bench_serve._levels(args.levels)
    except ValueError as exc:
        print(f"serving_peers: {exc}", file=sys.stderr)
        return 2

    results: dict[str, dict[int, dict]] = {}
    for name, url, backend in args.server:
        results[name] = {}
        for level in levels:
            print(f"{name} ({backend}, {url}): concurrency {level} ...", file=sys.stderr, flush=True)
            try:
                results[name][level] = measure(url, backend, level, args)
            except Exception as exc:  # a peer that fails is reported, the others still run
                print(f"serving_peers: {name} at concurrency {level}: {exc}", file=sys.stderr)

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
    for n in names[1:]:
        for level in levels:
            a, b = results[first].get(level), results[n].get(level)
            if a and b and b["output_throughput"] > 0:
                print(f"C={level}: {first} / {n} output tok/s = {a['output_throughput'] / b['output_throughput']:.2f}x, "
                      f"TTFT p50 {a['ttft_ms']['p50'] / 1e3:.2f} s vs {b['ttft_ms']['p50'] / 1e3:.2f} s")
    report = {"input_len": args.input_len, "output_len": args.output_len,
              "servers": {n: {"url": u, "backend": b} for n, u, b in args.server},
              "results": {n: {str(k): v for k, v in r.items()} for n, r in results.items()}}
    emit_json(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
