"""The int8 paths of the CPU packed linear under several kernel builds, side
by side: one whole step of the default model's matrices (30 layers of qkv,
o_proj, gate_up, down with their own weights, plus the q8_0 lm_head), each
matrix a CpuPackedLinear with persistent weight panels as the engine runs
it, timed per M with the builds alternating round by round (best round of
each), so that load from other processes falls on all builds alike.

    python benchmarks/linear_builds.py [--builds avx512,amx] [--activations int8x2,int8]
        [--rows 8 16 32 64 128 256] [--rounds 10] [--json PATH]

Builds are paged._C_cpu.supported_linear_isas() names; those this CPU lacks
are reported and left out. The builds compared here are bitwise equal
(tests/test_quant_linear_int8.py), so only their speed differs.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import torch

from linear_gflops import SHAPES, packed_blocks
from paged import _C_cpu as C
from paged.backends.cpu.quant_linear import CpuPackedLinear
from timing import emit_json


def step_matrices(activations: str, rng) -> list[tuple[CpuPackedLinear, int]]:
    """(matrix, calls per step): a copy per layer, the lm_head once."""
    out = []
    for _, qtype, n, k, count in SHAPES:
        for _ in range(count):
            w = CpuPackedLinear(packed_blocks(qtype, n, k, rng), activations=activations)
            w.use_panels = True
            out.append((w, k))
    return out


def time_step(mats, xs, builds: list[str], rounds: int) -> dict[str, float]:
    def run():
        for (w, k), x in zip(mats, xs):
            w.linear(x)
    for b in builds:  # panels of each build's layout, caches warm
        C.set_linear_isa(b)
        run()
    best = {b: float("inf") for b in builds}
    for _ in range(rounds):
        for b in builds:
            C.set_linear_isa(b)
            t0 = time.perf_counter()
            run()
            best[b] = min(best[b], time.perf_counter() - t0)
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--builds", default="avx512,amx")
    ap.add_argument("--activations", default="int8x2,int8")
    ap.add_argument("--rows", type=int, nargs="+", default=[8, 16, 32, 64, 128, 256])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--json", default=None, metavar="PATH")
    args = ap.parse_args()
    supported = C.supported_linear_isas()
    builds = [b for b in args.builds.split(",") if b]
    missing = [b for b in builds if b not in supported]
    if missing:
        print(f"linear_builds: this CPU lacks build(s) {', '.join(missing)} (it runs {', '.join(supported)})",
              file=sys.stderr)
        builds = [b for b in builds if b in supported]
    if not builds:
        return 2
    rng = np.random.default_rng(0)
    print(f"whole step of the default model's matrices, ms (best of {args.rounds} alternating rounds); "
          f"threads {torch.get_num_threads()}")
    print(f"{'path':>7} {'M':>4} | " + " ".join(f"{b:>9}" for b in builds)
          + (f" | {builds[0]}/{builds[-1]}" if len(builds) > 1 else ""))
    table = []
    for act in args.activations.split(","):
        mats = step_matrices(act, rng)
        for m in args.rows:
            xs = [torch.randn(m, k) for _, k in mats]
            best = time_step(mats, xs, builds, args.rounds)
            table.append({"activations": act, "M": m, "ms": {b: t * 1e3 for b, t in best.items()}})
            ratio = f" | {best[builds[0]] / best[builds[-1]]:.2f}" if len(builds) > 1 else ""
            print(f"{act:>7} {m:4} | " + " ".join(f"{best[b] * 1e3:9.2f}" for b in builds) + ratio, flush=True)
        C.set_linear_isa("auto")
    emit_json({"builds": builds, "rounds": args.rounds, "rows": table}, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
