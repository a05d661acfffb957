"""``paged conformance --device X [--quick] [--json report.json]``.

Exit status: 0 when the platform conforms (no required check failed and at
least one passed), 1 when it does not; the dispatcher (core/entrypoints/cli.py) exits 2
with one line when the platform itself is unavailable.
"""

from __future__ import annotations

import argparse

from paged.core.conformance.runner import run_suite


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true",
                        help="fewer random cases and shorter generations (about a minute on CPU)")
    parser.add_argument("--json", metavar="PATH", default=None, help="also write the report as JSON to PATH")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random cases (default: 0)")
    parser.add_argument("--only", metavar="TEXT", default=None, help="run only checks whose name contains TEXT")


def run(args: argparse.Namespace) -> int:
    platform = getattr(args, "platform", None)
    if platform is None:
        from paged.platforms import get_platform

        platform = get_platform(args.device)
    report = run_suite(platform, quick=args.quick, seed=args.seed, only=args.only)
    print(report.table(), flush=True)
    if args.json:
        report.write_json(args.json)
    return 0 if report.passed else 1
