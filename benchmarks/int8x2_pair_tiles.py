"""The AVX2 build's int8x2 pair tiles against its byte tiles, interleaved in
one process (both see the same machine load; PAGED_INT8_PAIRS=0 keeps the
byte tiles, read per call; docs/cpu-linear.md, "Builds"):

    python benchmarks/int8x2_pair_tiles.py [--qtypes q8_0 q4_0] [--rows 16 128] [--threads 1 2]
        [--rounds 5] [--engine /tmp/q1b/tinyllama-shape-Q8_0.gguf] [--json PATH]

Kernel: quant_linear(activations="int8x2") on random weights of the 1B
shapes (N x K = 2048 x 2048, 5632 x 2048, 2048 x 5632), per M and thread
count, the two paths alternating each round; best and median ms, and
whether their outputs are bitwise equal (they must be). --engine: one
engine (2 threads pinned, auto activations) on a GGUF file, 128-token
prefills and 16-stream decode steps (M = 16) alternating the two paths;
tok/s per round. Ratios are old / new time (or new / old tok/s).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from timing import emit_json, positive_int  # noqa: E402

SHAPES = [(2048, 2048), (5632, 2048), (2048, 5632)]
PATHS = {"byte": "0", "pair": "1"}  # PAGED_INT8_PAIRS


def use(path: str) -> None:
    os.environ["PAGED_INT8_PAIRS"] = PATHS[path]


def random_q8_or_q4(qtype: str, n: int, k: int, gen: torch.Generator):
    nb = k // 32
    d = torch.rand(n, nb, generator=gen) * 0.01 + 0.001
    if qtype == "q8_0":
        return torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen), d, None
    qs = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    return qs, d, (torch.rand(n, nb, generator=gen) - 0.5) * 0.01 if qtype == "q4_1" else None


def kernel(qtypes, rows, threads, rounds) -> dict:
    from paged import _C_cpu as C

    gen = torch.Generator().manual_seed(0)
    report = {}
    for t in threads:
        torch.set_num_threads(t)
        for qtype in qtypes:
            for n, k in SHAPES:
                qs, d, m = random_q8_or_q4(qtype, n, k, gen)
                for rows_m in rows:
                    x = torch.randn(rows_m, k, generator=gen)
                    reps = max(1, int(2e8 / (rows_m * n * k)))
                    times, outs = {p: [] for p in PATHS}, {}
                    for _ in range(rounds):
                        for p in PATHS:
                            use(p)
                            out = torch.empty(rows_m, n)
                            C.quant_linear(x, qtype, qs, d, m, out, "int8x2")
                            t0 = time.perf_counter()
                            for _ in range(reps):
                                C.quant_linear(x, qtype, qs, d, m, out, "int8x2")
                            times[p].append((time.perf_counter() - t0) / reps * 1e3)
                            outs[p] = out
                    key = f"{qtype} threads={t} M={rows_m} N={n} K={k}"
                    med = {p: statistics.median(v) for p, v in times.items()}
                    report[key] = {"best_ms": {p: min(v) for p, v in times.items()}, "median_ms": med,
                                   "byte_over_pair_median": med["byte"] / med["pair"],
                                   "bitwise_equal": torch.equal(outs["byte"], outs["pair"])}
                    print(f"{key:40s} byte {med['byte']:7.2f} ms  pair {med['pair']:7.2f} ms  "
                          f"{med['byte'] / med['pair']:.2f}x  equal={report[key]['bitwise_equal']}", flush=True)
    return report


def engine_steps(path: str, rounds: int) -> dict:
    from paged.core.engine.config import EngineConfig
    from paged.core.engine.engine import Engine
    from paged.core.engine.sampling_params import SamplingParams

    cpus = sorted(os.sched_getaffinity(0))[:2]
    prompt_len = 128
    engine = Engine(EngineConfig(model=path, device="cpu", max_model_len=1024, kv_cache_memory="512MiB",
                                 max_num_seqs=16, max_num_batched_tokens=prompt_len, itl_target_ms=None,
                                 cpu_threads_bind=",".join(map(str, cpus))))
    prefill, decode = {p: [] for p in PATHS}, {p: [] for p in PATHS}
    for r in range(rounds):
        for p in PATHS if r % 2 == 0 else reversed(PATHS):
            use(p)
            engine.add_request(f"p{r}{p}", [100 + (i * 7 + r) % 1000 for i in range(prompt_len)],
                               SamplingParams(max_tokens=1))
            t0 = time.perf_counter()
            while engine.has_unfinished_requests():
                engine.step()
            prefill[p].append(prompt_len / (time.perf_counter() - t0))
    for i in range(16):
        engine.add_request(f"s{i}", [5 + i, 6, 7, 8, 9 + i],
                           SamplingParams(max_tokens=10**4, ignore_eos=True, temperature=0.0))
    for _ in range(4):
        engine.step()  # the prompts, then decode steps of 16 rows
    for r in range(2 * rounds):
        for p in PATHS if r % 2 == 0 else reversed(PATHS):
            use(p)
            engine.step()
            t0 = time.perf_counter()
            for _ in range(4):
                engine.step()
            decode[p].append(16 * 4 / (time.perf_counter() - t0))
    engine.close()
    out = {"prefill_tok_s": prefill, "streams16_tok_s": decode}
    for key, runs in list(out.items()):
        out[key + "_pair_over_byte"] = {"best": max(runs["pair"]) / max(runs["byte"]),
                                        "median": statistics.median(runs["pair"]) / statistics.median(runs["byte"])}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--qtypes", nargs="+", default=["q8_0", "q4_0", "q4_1"], choices=["q8_0", "q4_0", "q4_1"])
    ap.add_argument("--rows", type=positive_int, nargs="+", default=[16, 128])
    ap.add_argument("--threads", type=positive_int, nargs="+", default=[1, 2])
    ap.add_argument("--rounds", type=positive_int, default=5)
    ap.add_argument("--engine", metavar="GGUF", help="also time an engine on this file")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args()
    report = {"load_average_before": os.getloadavg()}
    report["kernel"] = kernel(args.qtypes, args.rows, args.threads, args.rounds)
    if args.engine:
        e = report["engine"] = engine_steps(args.engine, args.rounds)
        print(f"engine: prefill pair/byte best {e['prefill_tok_s_pair_over_byte']['best']:.2f}x median "
              f"{e['prefill_tok_s_pair_over_byte']['median']:.2f}x; 16 streams best "
              f"{e['streams16_tok_s_pair_over_byte']['best']:.2f}x median "
              f"{e['streams16_tok_s_pair_over_byte']['median']:.2f}x", flush=True)
    report["load_average_after"] = os.getloadavg()
    emit_json(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
