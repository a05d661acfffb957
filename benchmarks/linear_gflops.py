"""GFLOP/s of the CPU packed linear per row count M, as the engine dispatches
it, against torch matmul on dense weights and the CPU's int8 peak.

The default model's matrices (SmolLM2-135M: 30 layers of q4_1 qkv 960x576,
o_proj 576x576, gate_up 3072x576, down 576x1536, plus the q8_0 lm_head
49152x576), timed per M and summed over a step (30 layers + lm_head):

  float32  CpuPackedLinear(activations="float32").linear: the packed kernel
           (int16 / fp32 activations) below DENSE_ROWS rows, dequantize +
           torch's fp32 GEMM from there (the engine's path today)
  int8     CpuPackedLinear(activations="int8").linear: int8 activations, any M
  int8x2   CpuPackedLinear(activations="int8x2").linear: int8 plus the residual's int8
  mixed    derived, not timed apart: what `auto` (mixed) runs for M prompt rows, the int8x2
           time of qkv (its K/V are cached) and lm_head, the int8 time of o_proj, gate_up, down
           (M decode rows run int8x2 everywhere: that column)
  amxbf16  CpuPackedLinear(activations="mixed-bf16").linear on prompt rows: AMX-BF16 tiles made
           per call from the int8 panels (what mixed-bf16 runs for prompts; CPUs with AMX-BF16
           only, else the column is left out)
  bf16     torch.matmul(x.bfloat16(), W_bf16.T) (oneDNN)
  fp32     torch.matmul(x, W.T)

Up to M = 16 each layer has its own weights (cycled), so weights stream from
DRAM as in decoding; above, one weight per shape (compute-bound). The four
paths are timed in alternating rounds (best round each), so a ratio within a
row holds even while other processes load the machine. GFLOP/s =
2 * M * (weights of a step) / time. The peak printed is cores x GHz x int8
MACs per cycle x 2, with the assumptions printed beside it.

    python benchmarks/linear_gflops.py [--rows 1 2 4 ...] [--threads N] [--quick] [--json PATH] [--ghz F]
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

from paged import _C_cpu as C
from paged.backends.cpu import quant_linear as packed_linear
from paged.backends.cpu.quant_linear import CpuPackedLinear
from paged.core.models.loaders.packed import PackedBlocks

LAYERS = 30
ROTATE_MAX_ROWS = 16  # up to this M, each layer has its own weights
SHAPES = [  # name, GGUF type, N, K, matrices per step
    ("qkv", Q.Q4_1, 960, 576, LAYERS),
    ("o_proj", Q.Q4_1, 576, 576, LAYERS),
    ("gate_up", Q.Q4_1, 3072, 576, LAYERS),
    ("down", Q.Q4_1, 576, 1536, LAYERS),
    ("lm_head", Q.Q8_0, 49152, 576, 1),
]
PATHS = ["float32", "int8", "int8x2"] + (["amxbf16"] if C.bf16_prompt_supported() else []) + ["bf16", "fp32"]
MIXED_TWO_TERM = ("qkv", "lm_head")  # shapes whose prompt rows keep two terms under mixed
COLUMNS = PATHS[:3] + ["mixed"] + PATHS[3:]
# int8 multiply-adds per cycle and core of one build's inner instruction, as assumed for the peak
MACS_PER_CYCLE = {
    "avx512": (64, "1 zmm vpdpbusd (64 MACs) per cycle per core (Zen 4: two 256-bit pipes; Intel: port 0 (+5))"),
    "amx": (512, "1 tdpbsud of 16 x 16 x 32 MACs per 16 cycles per core (one 32-block per tile: half the"
                 " unit's 64-byte K); the per-block fp32 steps run beside it on the vector units"),
    "avxvnni": (64, "2 ymm vpdpbusd (32 MACs each) per cycle per core"),
    "avx2": (32, "2 ymm vpmaddubsw (32 MACs) per cycle, halved for the vpmaddwd + add that follow"),
    "scalar": (1, "1 multiply-add per cycle"),
}


def packed_blocks(qtype: Q, n: int, k: int, rng: np.random.Generator) -> PackedBlocks:
    """Random GGUF blocks: fp16 scales (and q4_1 offsets) and random codes."""
    nb = k // 32
    scale = (rng.random((n, nb, 1)) * 0.02).astype(np.float16).view(np.uint8)
    if qtype == Q.Q8_0:
        raw = np.concatenate([scale, rng.integers(0, 256, (n, nb, 32), dtype=np.uint8)], axis=2)
    else:
        offset = (rng.random((n, nb, 1)) * -0.1).astype(np.float16).view(np.uint8)
        raw = np.concatenate([scale, offset, rng.integers(0, 256, (n, nb, 16), dtype=np.uint8)], axis=2)
    return PackedBlocks(qtype, torch.from_numpy(raw.reshape(n, -1).copy()), (n, k))


def cpu_ghz(override: float | None) -> float:
    if override:
        return override
    with open("/proc/cpuinfo") as f:
        mhz = [float(line.split(":")[1]) for line in f if line.startswith("cpu MHz")]
    return max(mhz) / 1e3 if mhz else float("nan")


def time_shape(shape, m_rows: int, min_time: float, rng) -> dict:
    """Seconds per call of each path on one shape (cycling its layer copies)."""
    name, qtype, n, k, count = shape
    copies = count if m_rows <= ROTATE_MAX_ROWS else 1
    blocks = [packed_blocks(qtype, n, k, rng) for _ in range(copies)]
    f32 = [CpuPackedLinear(b) for b in blocks]
    i8 = [CpuPackedLinear(b, activations="int8") for b in blocks]
    i8x2 = [CpuPackedLinear(b, activations="int8x2") for b in blocks]
    amx = [CpuPackedLinear(b, activations="mixed-bf16") for b in blocks] if "amxbf16" in PATHS else []
    for w in i8 + i8x2 + amx:  # persistent int8 panels, built once as the worker does at load
        w.use_panels = True
        w.weight_panels()
    dense = []
    for w in f32:
        out = torch.empty(n, k)
        C.quant_dequantize(w.kernel_qtype, w.qs, w.d, w.m, out)
        dense.append(out)
    dense_bf16 = [w.bfloat16() for w in dense]
    x = torch.randn(m_rows, k)
    x_bf16 = x.bfloat16()
    calls = {
        "float32": lambda: [w.linear(x) for w in f32],
        "int8": lambda: [w.linear(x) for w in i8],
        "int8x2": lambda: [w.linear(x) for w in i8x2],
        "amxbf16": lambda: [w.linear(x, first_prompt_row=0) for w in amx],
        "bf16": lambda: [torch.matmul(x_bf16, w.T) for w in dense_bf16],
        "fp32": lambda: [torch.matmul(x, w.T) for w in dense],
    }
    calls = {path: calls[path] for path in PATHS}
    return {path: t / copies for path, t in interleaved_best(calls, min_time).items()}


def interleaved_best(calls: dict, min_time: float, min_rounds: int = 3) -> dict:
    """Best seconds per call of each function, timed in alternating rounds
    (one call of each per round) so that other processes' load, which comes
    and goes on a shared machine, falls on all of them alike."""
    for fn in calls.values():  # warm-up
        fn()
    times = {name: [] for name in calls}
    start = time.perf_counter()
    while len(times[next(iter(calls))]) < min_rounds or time.perf_counter() - start < min_time * len(calls):
        for name, fn in calls.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: min(ts) for name, ts in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 256, 512])
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--quick", action="store_true", help="shorter timing loops")
    ap.add_argument("--json", help="write the table here")
    ap.add_argument("--ghz", type=float, help="clock for the peak (default: /proc/cpuinfo's cpu MHz)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    min_time = 0.15 if args.quick else 0.5
    isa = C.linear_isa()
    ghz = cpu_ghz(args.ghz)
    macs, assumption = MACS_PER_CYCLE.get(isa, (float("nan"), "unknown build"))
    peak = args.threads * ghz * macs * 2
    flop_per_row = 2.0 * sum(n * k * count for _, _, n, k, count in SHAPES)
    print(f"linear build={isa} threads={args.threads} torch={torch.__version__} cpu={platform.processor() or '?'}"
          f" DENSE_ROWS={packed_linear.DENSE_ROWS}")
    print(f"int8 peak = {args.threads} cores x {ghz:.2f} GHz x {macs} MACs/cycle x 2 = {peak:.0f} GOP/s"
          f" (assumed: {assumption})")
    print(f"whole step ({LAYERS} layers + lm_head), ms and GFLOP/s:")
    print(f"{'M':>5} | " + " ".join(f"{p + ' ms':>10}" for p in COLUMNS) + " | "
          + " ".join(f"{p + ' GF':>10}" for p in COLUMNS) + f" | {'int8/bf16':>9} {'mixed/bf16':>10} {'int8/f32':>8}")
    rng = np.random.default_rng(0)
    table = []
    for m_rows in args.rows:
        per_shape = {s[0]: time_shape(s, m_rows, min_time, rng) for s in SHAPES}
        ms = {p: sum(per_shape[s[0]][p] * s[4] for s in SHAPES) * 1e3 for p in PATHS}
        ms["mixed"] = sum(per_shape[s[0]]["int8x2" if s[0] in MIXED_TWO_TERM else "int8"] * s[4]
                          for s in SHAPES) * 1e3
        gflops = {p: flop_per_row * m_rows / (ms[p] * 1e-3) / 1e9 for p in COLUMNS}
        table.append({"M": m_rows, "ms": ms, "GFLOPs": gflops, "per_shape_s": per_shape})
        print(f"{m_rows:5} | " + " ".join(f"{ms[p]:10.2f}" for p in COLUMNS) + " | "
              + " ".join(f"{gflops[p]:10.1f}" for p in COLUMNS)
              + f" | {ms['bf16'] / ms['int8']:9.2f} {ms['bf16'] / ms['mixed']:10.2f} {ms['float32'] / ms['int8']:8.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"isa": isa, "threads": args.threads, "ghz": ghz, "peak_GOPs": peak,
                       "peak_assumption": assumption, "dense_rows": packed_linear.DENSE_ROWS, "rows": table},
                      f, indent=1)


if __name__ == "__main__":
    main()
