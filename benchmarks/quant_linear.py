"""Benchmark of the CPU quantized linear against torch F.linear on dense weights.

Shapes of the default model (SmolLM2-135M: hidden 576, intermediate 1536,
30 layers, vocab 49152) at M = 1 / 16 / 256 rows: time per call, GB/s of the
packed bytes read (codes + float32 scales), GFLOP/s, and torch F.linear with the dense fp32
and bf16 weights in the same run. Up to M = 16 each of the 30
layers has its own weights (cycled), so the dense fp32 model (~540 MB) streams
from DRAM while the packed one (~100 MB) can stay in L3, as in real decoding. Then a whole-model estimate
(30 layers + lm_head) of the matmul time per step at M = 1 and M = 16.

    python benchmarks/quant_linear.py [--quick] [--json PATH] [--threads N] [--isa NAME]
        [--rows M ...] [--activations float32|int8|int8x2] [--panels] [--baseline OLD_C_CPU_SO ...]

(--activations int8 times the int8-activation path; benchmarks/linear_gflops.py
compares both paths as the engine dispatches them, per M, in GFLOP/s. --panels,
with int8 / int8x2 on the avx512 build, also times each call with the
weight's persistent panels (build_weight_panels) in a "panels us" column, and
the whole-model estimate with them.)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import subprocess
import sys
import tempfile

import torch
from timing import best_time
import torch.nn.functional as F

from paged.backends.cpu.attention import dl

C = None  # the extension under test, set by load_extension()


def load_extension(path: str | None) -> None:
    """paged._C_cpu, or the build at `path` under that name (before anything
    else imports it, so the whole process uses that build)."""
    global C
    if path:
        spec = importlib.util.spec_from_file_location("paged._C_cpu", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules["paged._C_cpu"] = module
        spec.loader.exec_module(module)
    from paged import _C_cpu

    C = _C_cpu

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
    """Random packed arrays; the scales are fp16 values (as GGUF stores them) held in float32."""
    blocks = k // 32
    d = (torch.rand(n, blocks, generator=gen) * 0.02).half().float()
    if qtype == "q8_0":
        qs = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen)
    else:
        qs = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    m = (torch.rand(n, blocks, generator=gen) * -0.1).half().float() if qtype == "q4_1" else None
    return qs, d, m


ACTIVATIONS = "float32"  # the kernel's activations argument (--activations)
PANELS = False  # also time the calls with persistent weight panels (--panels)


def weight_panels(qtype, qs, d, m) -> torch.Tensor:
    panels = torch.empty(C.weight_panel_bytes(qtype, dl(qs), dl(d), dl(m)), dtype=torch.uint8)
    C.build_weight_panels(qtype, dl(qs), dl(d), dl(m), dl(panels))
    return panels


def bench_shape(name, qtype, n, k, m_rows, copies, min_time, gen, with_torch=True) -> dict:
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
    packed_bytes = qs.numel() + d.nbytes + (m.nbytes if m is not None else 0)

    extra = () if ACTIVATIONS == "float32" else (ACTIVATIONS,)  # builds before int8 lack the argument

    def quant():
        for qs, d, m in weights:
            C.quant_linear(dl(x), qtype, dl(qs), dl(d), dl(m), dl(out), *extra)

    t_q = best_time(quant, min_time) / copies
    nan = float("nan")
    t_p = nan
    if PANELS:
        cached = [(qs, d, m, weight_panels(qtype, qs, d, m)) for qs, d, m in weights]

        def quant_panels():
            for qs, d, m, p in cached:
                C.quant_linear(dl(x), qtype, dl(qs), dl(d), dl(m), dl(out), ACTIVATIONS, -1, dl(p))

        t_p = best_time(quant_panels, min_time) / copies
    t_f32 = best_time(lambda: [F.linear(x, w) for w in dense], min_time) / copies if with_torch else nan
    t_bf16 = best_time(lambda: [F.linear(x_bf16, w) for w in dense_bf16], min_time) / copies if with_torch else nan
    flop = 2.0 * m_rows * n * k
    return {
        "name": name, "qtype": qtype, "N": n, "K": k, "M": m_rows, "copies": copies,
        "packed_bytes": packed_bytes,
        "quant_us": t_q * 1e6, "panels_us": t_p * 1e6, "quant_GBps": packed_bytes / t_q / 1e9, "quant_GFLOPs": flop / t_q / 1e9,
        "torch_fp32_us": t_f32 * 1e6, "torch_bf16_us": t_bf16 * 1e6,
        "speedup_vs_fp32": t_f32 / t_q, "speedup_vs_bf16": t_bf16 / t_q,
    }


def measure(rows_list, threads, min_time, with_torch, show) -> list[dict]:
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    rows = []
    if show:
        print(f"{'shape':8} {'qtype':5} {'N':>6} {'K':>5} {'M':>4} | {'quant us':>9} {'GB/s':>6} {'GFLOP/s':>8} |"
              f" {'fp32 us':>9} {'bf16 us':>9} | {'x fp32':>6} {'x bf16':>6}" + (" | panels us" if PANELS else ""))
    for m_rows in rows_list:
        for name, qtype, n, k, count in SHAPES:
            # Many rows are compute-bound: one weight (cached) is representative and quicker.
            copies = count if m_rows <= ROTATE_MAX_ROWS else 1
            r = bench_shape(name, qtype, n, k, m_rows, copies, min_time, gen, with_torch)
            rows.append(r)
            if show:
                print(f"{name:8} {qtype:5} {n:6} {k:5} {m_rows:4} | {r['quant_us']:9.1f} {r['quant_GBps']:6.1f}"
                      f" {r['quant_GFLOPs']:8.1f} | {r['torch_fp32_us']:9.1f} {r['torch_bf16_us']:9.1f} |"
                      f" {r['speedup_vs_fp32']:6.2f} {r['speedup_vs_bf16']:6.2f}"
                      + (f" | {r['panels_us']:9.1f}" if PANELS else ""))
    return rows


def whole_model(rows: list[dict], m_rows: int, key: str, unit: float = 1e3) -> float:
    """rows[key] summed over a step of the 30 layers + lm_head, divided by
    `unit` (us -> ms by default; 1e6 for packed_bytes -> MB)."""
    per = {r["name"]: r for r in rows if r["M"] == m_rows}
    return sum(per[name][key] * count for name, _, _, _, count in SHAPES) / unit


def run_baseline(args, path: str) -> list[dict]:
    """This script's measurement of the build at `path`, in a child process."""
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        cmd = [sys.executable, __file__, "--extension", path, "--no-torch", "--json", f.name,
               "--threads", str(args.threads), "--activations", args.activations,
               "--rows", *map(str, args.rows)] + (["--quick"] if args.quick else [])
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        return json.load(f)["shapes"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="shorter timing loops")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--isa", default="auto", help="auto or a build from paged._C_cpu.supported_linear_isas()")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 256])
    ap.add_argument("--activations", choices=["float32", "int8", "int8x2"], default="float32",
                    help="the kernel's activations argument (int8: x quantized per 32-block; "
                         "int8x2: plus the residual's int8)")
    ap.add_argument("--panels", action="store_true",
                    help="also time the int8 paths with persistent weight panels (avx512 build)")
    ap.add_argument("--baseline", nargs="+", default=[],
                    help="other _C_cpu*.so builds to time side by side (child processes, default ISA)")
    ap.add_argument("--extension", help=argparse.SUPPRESS)  # the child's build under test
    ap.add_argument("--no-torch", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    global ACTIVATIONS, PANELS
    ACTIVATIONS = args.activations
    PANELS = args.panels
    if PANELS and ACTIVATIONS == "float32":
        ap.error("--panels: expected --activations int8 or int8x2, got float32")
    baselines = [run_baseline(args, path) for path in args.baseline]
    load_extension(args.extension)
    C.set_linear_isa(args.isa)
    min_time = 0.2 if args.quick else 0.6

    print(f"isa={C.linear_isa()} activations={args.activations} threads={args.threads} torch={torch.__version__}"
          f" cpu={platform.processor()}")
    rows = measure(args.rows, args.threads, min_time, not args.no_torch, show=not args.no_torch)
    model = {}
    for m_rows in args.rows:
        total = {key: whole_model(rows, m_rows, key)
                 for key in ("quant_us", "panels_us", "torch_fp32_us", "torch_bf16_us")}
        megabytes = whole_model(rows, m_rows, "packed_bytes", 1e6)
        model[m_rows] = {"quant_ms": total["quant_us"], "torch_fp32_ms": total["torch_fp32_us"],
                         "torch_bf16_ms": total["torch_bf16_us"], "packed_MB": megabytes}
        print(f"whole model (30 layers + lm_head) M={m_rows}: quant {total['quant_us']:.2f} ms ({megabytes:.1f} MB),"
              f" torch fp32 {total['torch_fp32_us']:.2f} ms, torch bf16 {total['torch_bf16_us']:.2f} ms"
              f" -> x{total['torch_fp32_us'] / total['quant_us']:.2f} vs fp32,"
              f" x{total['torch_bf16_us'] / total['quant_us']:.2f} vs bf16"
              + (f"; with panels {total['panels_us']:.2f} ms" if PANELS else ""))
    if baselines:
        names = [f"base{i + 1}" for i in range(len(baselines))]
        print("\nbaselines (measured first) vs this build:")
        for name, path in zip(names, args.baseline):
            print(f"  {name} = {path}")
        print(f"{'shape':8} {'M':>4} | " + " ".join(f"{n + ' us':>9}" for n in names) + f" {'this us':>9} | "
              + " ".join(f"{'x ' + n:>8}" for n in names))
        for i, new in enumerate(rows):
            olds = [b[i]["quant_us"] for b in baselines]
            print(f"{new['name']:8} {new['M']:4} | " + " ".join(f"{o:9.1f}" for o in olds) + f" {new['quant_us']:9.1f} | "
                  + " ".join(f"{o / new['quant_us']:8.2f}" for o in olds))
        for m_rows in args.rows:
            olds = [whole_model(b, m_rows, "quant_us") for b in baselines]
            old_mb = [whole_model(b, m_rows, "packed_bytes", 1e6) for b in baselines]
            new_ms, new_mb = model[m_rows]["quant_ms"], model[m_rows]["packed_MB"]
            model[m_rows]["baseline_quant_ms"] = olds
            model[m_rows]["baseline_packed_MB"] = old_mb
            print(f"whole model M={m_rows}: "
                  + ", ".join(f"{n} {o:.2f} ms ({b:.1f} MB)" for n, o, b in zip(names, olds, old_mb))
                  + f", this {new_ms:.2f} ms ({new_mb:.1f} MB)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"isa": C.linear_isa(), "threads": args.threads, "shapes": rows, "model": model,
                       "baselines": args.baseline, "baseline_shapes": baselines}, f, indent=1)
    C.set_linear_isa("auto")


if __name__ == "__main__":
    main()
