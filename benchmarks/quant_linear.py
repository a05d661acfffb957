"""Benchmark of the CPU quantized linear against torch F.linear on dense weights.

Shapes of the default model (SmolLM2-135M: hidden 576, intermediate 1536,
30 layers, vocab 49152) at M = 1 / 16 / 256 rows: time per call, GB/s of the
packed bytes read (codes + fp32 scales), GFLOP/s, and torch F.linear with the
dense fp32 and bf16 weights in the same run. Up to M = 16 each of the 30
layers has its own weights (cycled), so the dense fp32 model (~540 MB) streams
from DRAM while the packed one (~100 MB) can stay in L3, as in real decoding. Then a whole-model estimate
(30 layers + lm_head) of the matmul time per step at M = 1 and M = 16.

    python benchmarks/quant_linear.py [--quick] [--json PATH] [--threads N] [--isa NAME]
"""

from __future__ import annotations

import argparse
import json
import platform

import torch
from timing import best_time
import torch.nn.functional as F

from paged import _C_cpu as C

LAYERS = 30
# name, qtype, N, K, count per model step
ROTATE_MAX_ROWS = 16  # up to this M, each layer has its own weight (DRAM-like traffic)
SHAPES = [
    ("qkv", "q4_1", 960, 576, LAYERS),
    ("o_proj", "q4_1", 576, 576, LAYERS),
    ("gate_up", "q4_1", 3072, 576, LAYERS),
    ("down", "q4_1", 576, 1536, LAYERS),
    ("lm_head", "q8_0", 49152, 576, 1),
]


def packed_weight(qtype: str, n: int, k: int, gen: torch.Generator):
    blocks = k // 32
    d = (torch.rand(n, blocks, generator=gen) * 0.02).half().float()
    if qtype == "q8_0":
        qs = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen)
    else:
        qs = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    m = (torch.rand(n, blocks, generator=gen) * -0.1).half().float() if qtype == "q4_1" else None
    return qs, d, m


def bench_shape(name, qtype, n, k, m_rows, copies, min_time, gen) -> dict:
    """Times one call per copy, cycling through `copies` distinct weights (one
    per layer), so dense weights come from DRAM as in a real step."""
    weights, dense, dense_bf16 = [], [], []
    for _ in range(copies):
        qs, d, m = packed_weight(qtype, n, k, gen)
        w = torch.empty(n, k)
        C.quant_dequantize(qtype, qs, d, m, w)
        weights.append((qs, d, m))
        dense.append(w)
        dense_bf16.append(w.bfloat16())
    x = torch.randn(m_rows, k, generator=gen)
    x_bf16 = x.bfloat16()
    out = torch.empty(m_rows, n)
    qs, d, m = weights[0]
    packed_bytes = qs.numel() + 4 * d.numel() + (4 * m.numel() if m is not None else 0)

    def quant():
        for qs, d, m in weights:
            C.quant_linear(x, qtype, qs, d, m, out)

    t_q = best_time(quant, min_time) / copies
    t_f32 = best_time(lambda: [F.linear(x, w) for w in dense], min_time) / copies
    t_bf16 = best_time(lambda: [F.linear(x_bf16, w) for w in dense_bf16], min_time) / copies
    flop = 2.0 * m_rows * n * k
    return {
        "name": name, "qtype": qtype, "N": n, "K": k, "M": m_rows, "copies": copies,
        "quant_us": t_q * 1e6, "quant_GBps": packed_bytes / t_q / 1e9, "quant_GFLOPs": flop / t_q / 1e9,
        "torch_fp32_us": t_f32 * 1e6, "torch_bf16_us": t_bf16 * 1e6,
        "speedup_vs_fp32": t_f32 / t_q, "speedup_vs_bf16": t_bf16 / t_q,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="shorter timing loops")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--isa", default="auto", help=f"one of auto, {', '.join(C.supported_linear_isas())}")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 256])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    C.set_linear_isa(args.isa)
    min_time = 0.2 if args.quick else 0.6
    gen = torch.Generator().manual_seed(0)

    rows = []
    print(f"isa={C.linear_isa()} threads={args.threads} torch={torch.__version__} cpu={platform.processor()}")
    print(f"{'shape':8} {'qtype':5} {'N':>6} {'K':>5} {'M':>4} | {'quant us':>9} {'GB/s':>6} {'GFLOP/s':>8} |"
          f" {'fp32 us':>9} {'bf16 us':>9} | {'x fp32':>6} {'x bf16':>6}")
    for m_rows in args.rows:
        for name, qtype, n, k, count in SHAPES:
            # Many rows are compute-bound: one weight (cached) is representative and quicker.
            copies = count if m_rows <= ROTATE_MAX_ROWS else 1
            r = bench_shape(name, qtype, n, k, m_rows, copies, min_time, gen)
            rows.append(r)
            print(f"{name:8} {qtype:5} {n:6} {k:5} {m_rows:4} | {r['quant_us']:9.1f} {r['quant_GBps']:6.1f}"
                  f" {r['quant_GFLOPs']:8.1f} | {r['torch_fp32_us']:9.1f} {r['torch_bf16_us']:9.1f} |"
                  f" {r['speedup_vs_fp32']:6.2f} {r['speedup_vs_bf16']:6.2f}")

    model = {}
    for m_rows in args.rows:
        per = {r["name"]: r for r in rows if r["M"] == m_rows}
        counts = {name: count for name, _, _, _, count in SHAPES}
        total = {key: sum(per[name][key] * counts[name] for name in counts) / 1e3
                 for key in ("quant_us", "torch_fp32_us", "torch_bf16_us")}
        model[m_rows] = {"quant_ms": total["quant_us"], "torch_fp32_ms": total["torch_fp32_us"],
                         "torch_bf16_ms": total["torch_bf16_us"]}
        print(f"whole model (30 layers + lm_head) M={m_rows}: quant {total['quant_us']:.2f} ms,"
              f" torch fp32 {total['torch_fp32_us']:.2f} ms, torch bf16 {total['torch_bf16_us']:.2f} ms"
              f" -> x{total['torch_fp32_us'] / total['quant_us']:.2f} vs fp32,"
              f" x{total['torch_bf16_us'] / total['quant_us']:.2f} vs bf16")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"isa": C.linear_isa(), "threads": args.threads, "shapes": rows, "model": model}, f, indent=1)
    C.set_linear_isa("auto")


if __name__ == "__main__":
    main()
