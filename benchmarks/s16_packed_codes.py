"""s16's packed codes (4-6 bits a code) against its int8 bytes
(docs/cpu-linear.md, "Packed codes"), side by side:

    python benchmarks/s16_packed_codes.py [--rows 1 2 16 128] [--threads 2] [--rounds 5]
        [--engine /tmp/q1b/tinyllama-shape-Q5_K_M.gguf ...] [--engine-rounds 2] [--json PATH]

Kernel: quant_linear on random codes of Q5_K's range (0..31, with offsets:
"s16.u5") and Q6_K's (-32..31: "s16.s6") at the 1B shapes (N x K = 2048 x
2048, 5632 x 2048, 2048 x 5632), "mixed"'s two settings (int8, int8x2),
weights cycled (96 MiB of int8 codes per shape, past the last-level
cache), the two forms alternating each round in one process; median ms, the bytes
each form's codes take, and whether the outputs are bitwise equal (they
must be). --engine: per GGUF file, one process per form and round
(PAGED_S16_PACKED=1 / 0, read at load; alternating order), the engine's
128-token prefill, batch-1 decode and RSS after load minus the KV cache
(benchmarks/quant_types.py measure_paged). Ratios are bytes' time over
packed's (or packed's tok/s over bytes').
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from timing import emit_json, positive_int  # noqa: E402

SHAPES = [(2048, 2048), (5632, 2048), (2048, 5632)]
CODES = {"q5_k-like": (0, 31, True), "q6_k-like": (-32, 31, False)}  # code range, offsets
COPY_BYTES = 96 << 20  # int8 codes cycled per shape (past a 32-64 MiB L3)


def kernel(rows, threads, rounds) -> dict:
    from paged import _C_cpu as C
    from paged.core.models.loaders.quant_layouts import pack_s16_codes

    gen = torch.Generator().manual_seed(0)
    report = {}
    torch.set_num_threads(threads)
    for name, (lo, hi, offsets) in CODES.items():
        for n, k in SHAPES:
            weights = []  # copies cycled per call, more bytes than a last-level cache: read from DRAM as in a model
            for _ in range(-(-COPY_BYTES // (n * k))):
                codes = torch.randint(lo, hi + 1, (n, k), dtype=torch.int8, generator=gen)
                d = torch.rand(n, k // 16, generator=gen) * 0.01
                m = (torch.rand(n, k // 16, generator=gen) - 0.5) * 0.01 if offsets else None
                packed, qtype = pack_s16_codes(codes)
                weights.append({"bytes": ("s16", codes, d, m), "packed": (qtype, packed, d, m)})
            for activations in ("int8", "int8x2"):
                for rows_m in rows:
                    x = torch.randn(rows_m, k, generator=gen)
                    reps = max(1, int(1e8 / (rows_m * n * k)))
                    times, outs = {f: [] for f in weights[0]}, {}
                    for r in range(rounds):
                        for f in ("bytes", "packed") if r % 2 == 0 else ("packed", "bytes"):
                            out = torch.empty(rows_m, n)
                            C.quant_linear(x, *weights[0][f], out, activations)
                            outs[f] = out.clone()
                            t0 = time.perf_counter()
                            for i in range(reps * len(weights)):
                                C.quant_linear(x, *weights[i % len(weights)][f], out, activations)
                            times[f].append((time.perf_counter() - t0) / (reps * len(weights)) * 1e3)
                    med = {f: statistics.median(v) for f, v in times.items()}
                    key = f"{name} {qtype} {activations} M={rows_m} N={n} K={k}"
                    report[key] = {"median_ms": med, "bytes_over_packed": med["bytes"] / med["packed"],
                                   "code_bytes": {"bytes": codes.numel(), "packed": packed.numel()},
                                   "copies": len(weights),
                                   "bitwise_equal": torch.equal(outs["bytes"], outs["packed"])}
                    print(f"{key:48s} bytes {med['bytes']:7.3f} ms  packed {med['packed']:7.3f} ms  "
                          f"{med['bytes'] / med['packed']:.2f}x  equal={report[key]['bitwise_equal']}", flush=True)
    return report


def engine_once(path: str, threads: int) -> dict:
    """One engine on ``path`` in this process (the form PAGED_S16_PACKED says)."""
    import quant_types

    args = argparse.Namespace(prompt_len=128, rounds=2, decode_tokens=32, threads=threads)
    return quant_types.measure_paged(path, args)


def engine(path: str, rounds: int, threads: int) -> dict:
    runs = {"packed": [], "bytes": []}
    for r in range(rounds):
        for form in ("bytes", "packed") if r % 2 == 0 else ("packed", "bytes"):
            env = dict(os.environ, PAGED_S16_PACKED="1" if form == "packed" else "0")
            out = subprocess.run([sys.executable, __file__, "--engine-once", path, "--threads", str(threads)],
                                 capture_output=True, text=True, env=env)
            lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
            if out.returncode or not lines:
                raise RuntimeError(f"engine run ({form}) failed: {out.stderr.strip()[-800:]}")
            res = json.loads(lines[0][len("RESULT "):])
            runs[form].append(res)
            print(f"  {os.path.basename(path)} {form}: prefill {res['prefill_tok_s']:.1f} tok/s, decode "
                  f"{res['decode_tok_s']:.2f} tok/s, RSS-KV/file {res['rss_minus_kv_bytes'] / res['file_bytes']:.3f}",
                  flush=True)
    ratio = lambda key: [p[key] / b[key] for p, b in zip(runs["packed"], runs["bytes"])]  # noqa: E731
    summary = {"prefill_packed_over_bytes": ratio("prefill_tok_s"), "decode_packed_over_bytes": ratio("decode_tok_s"),
               "rss_minus_kv_over_file": {f: [x["rss_minus_kv_bytes"] / x["file_bytes"] for x in v]
                                          for f, v in runs.items()}}
    print(f"  {os.path.basename(path)}: packed/bytes prefill {summary['prefill_packed_over_bytes']}, decode "
          f"{summary['decode_packed_over_bytes']}", flush=True)
    return {"runs": runs, **summary}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=positive_int, nargs="+", default=[1, 2, 16, 128])
    ap.add_argument("--threads", type=positive_int, default=2)
    ap.add_argument("--rounds", type=positive_int, default=5)
    ap.add_argument("--engine", metavar="GGUF", nargs="+", default=[], help="also time engines on these files")
    ap.add_argument("--engine-rounds", type=positive_int, default=2)
    ap.add_argument("--engine-once", metavar="GGUF", help=argparse.SUPPRESS)  # a child of --engine
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args()
    if args.engine_once:
        print("RESULT " + json.dumps(engine_once(args.engine_once, args.threads)), flush=True)
        return 0
    report = {"load_average_before": os.getloadavg(), "threads": args.threads}
    report["kernel"] = kernel(args.rows, args.threads, args.rounds)
    report["engine"] = {os.path.basename(p): engine(p, args.engine_rounds, args.threads) for p in args.engine}
    report["load_average_after"] = os.getloadavg()
    emit_json(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
