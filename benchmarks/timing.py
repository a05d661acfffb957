"""Timing (and argument parsing) shared by the benchmarks (run as `python
benchmarks/X.py`, which puts this folder on sys.path)."""

import argparse
import time


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1, else a usage error naming the value."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def best_time(fn, min_time: float, max_reps: int = 500, warmup: int = 1, min_reps: int = 3) -> float:
    """Best seconds per call after ``warmup`` calls, repeating for at least
    ``min_time`` seconds. On a shared machine the best of many runs is the
    figure least distorted by other processes."""
    for _ in range(warmup):
        fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < min_reps or (time.perf_counter() - start < min_time and len(times) < max_reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def emit_json(report, path=None) -> None:
    """Print the report as one JSON line (for scripts) and, given a path,
    also write it there indented."""
    import json

    print(json.dumps(report))
    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=2)
