"""`paged bench <what>`: benchmarks reachable from the CLI. For now `serve`
(core/bench/serve.py: an OpenAI-compatible server under load)."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from paged.core.bench import serve as bench_serve

    sub = parser.add_subparsers(dest="bench_command", metavar="{serve}")
    sub.required = True
    serve = sub.add_parser("serve", help="load an OpenAI-compatible server with streaming requests")
    bench_serve.add_arguments(serve)


def run(args: argparse.Namespace) -> int:
    if args.bench_command == "serve":
        from paged.core.bench import serve as bench_serve

        return bench_serve.run(args)
    raise ValueError(f"unknown bench command {args.bench_command!r}")
