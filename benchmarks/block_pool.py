"""Block pool speed: C++ BlockPool (paged._C_blocks) vs the pure-Python model of
the same rules (core/engine/block_pool_spec.py), side by side in one run.

    python benchmarks/block_pool.py [--blocks 1000000] [--json out.json]

Measures (1) allocate+free of --blocks blocks in request-sized batches
(16..256 blocks per call), (2) per-call overhead from Python of a 1-block
allocate+free pair, (3) prefix lookup of a 32-block cached chain.
"""

from __future__ import annotations

import argparse
import json
import time

from paged.core.engine.block_pool_spec import BlockPoolModel

POOL_SIZE = 8192


def _best_of(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def bench_batches(pool_cls, total_blocks: int, batch: int, repeat: int) -> float:
    """Blocks per second for allocate(batch) + free(batch) until total_blocks passed through."""
    pool = pool_cls(POOL_SIZE)
    calls = max(1, total_blocks // batch)

    def run():
        for _ in range(calls):
            pool.free(pool.allocate(batch))

    return calls * batch / _best_of(run, repeat)


def bench_call_overhead(pool_cls, calls: int, repeat: int) -> float:
    """Microseconds per allocate(1)+free pair."""
    pool = pool_cls(POOL_SIZE)

    def run():
        for _ in range(calls):
            pool.free(pool.allocate(1))

    return _best_of(run, repeat) / calls * 1e6


def bench_prefix_lookup(pool_cls, calls: int, repeat: int) -> float:
    """Microseconds per lookup_prefix of a 32-block cached chain (+ free of the hits)."""
    pool = pool_cls(POOL_SIZE)
    blocks = pool.allocate(32)
    hashes = list(range(1, 33))
    for b, h in zip(blocks, hashes):
        pool.register_hash(b, h)
    pool.free(blocks)

    def run():
        for _ in range(calls):
            pool.free(pool.lookup_prefix(hashes))

    return _best_of(run, repeat) / calls * 1e6


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=1_000_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    from paged._C_blocks import BlockPool

    impls = {"cpp": BlockPool, "python": BlockPoolModel}
    results: dict = {"blocks": args.blocks, "pool_size": POOL_SIZE, "batches": {}, "per_call_us": {},
                     "prefix_lookup32_us": {}}
    print(f"allocate+free of {args.blocks} blocks, pool of {POOL_SIZE}; best of {args.repeat}")
    print(f"{'batch':>6} {'cpp Mblk/s':>11} {'python Mblk/s':>14} {'speedup':>8}")
    for batch in (16, 64, 256):
        row = {name: bench_batches(cls, args.blocks, batch, args.repeat) for name, cls in impls.items()}
        row["speedup"] = row["cpp"] / row["python"]
        results["batches"][batch] = row
        print(f"{batch:>6} {row['cpp'] / 1e6:>11.2f} {row['python'] / 1e6:>14.2f} {row['speedup']:>7.1f}x")
    for key, fn, label in (("per_call_us", bench_call_overhead, "allocate(1)+free call pair"),
                           ("prefix_lookup32_us", bench_prefix_lookup, "lookup_prefix(32 hashes)+free")):
        row = {name: fn(cls, 20000, args.repeat) for name, cls in impls.items()}
        row["speedup"] = row["python"] / row["cpp"]
        results[key] = row
        print(f"{label:<32} cpp {row['cpp']:.2f} us   python {row['python']:.2f} us   {row['speedup']:.1f}x")
    print(json.dumps(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    main()
