"""The s16 kernel's rate by rows of x, beside q4_1 (Q4_K's layout) on the
same shapes (docs/cpu-linear.md, "GGUF types and the s16 layout"):

    python benchmarks/s16_rows.py [--rows 1 2 4 8 9 16 64 128] [--activations int8x2|int8] [--threads 2]
                                  [--rounds 5] [--panels | --crossover [--engine GGUF --streams 16 32]]
                                  [--json PATH]

quant_linear with int8x2 activations (what "mixed" gives most matrices;
--activations int8: its one-term layers' O, gate/up and down) on
random codes of Q5_K's range with offsets ("s16.u5"), Q6_K's ("s16.s6")
and q4_1 nibbles, at a 1B model's layer shapes (QKV 2560 x 2048, O 2048 x
2048, gate+up 11264 x 2048, down 2048 x 5632), enough copies that the
weights (codes and float32 scales) stream past a 32 MiB last-level cache as
decode's do. Per row count and layout: the best of --rounds passes over
every copy, as GFLOP/s (2 M N K / s) and GB/s of weight bytes read. To
compare two builds, run it under each (the figures are per process).
--panels (a build with persistent weight panels, docs/weight-panels.md):
each layout also with its panels, the two passes interleaved round by
round, and their ratio (GB/s counts the packed bytes for both).
--crossover: panels read in place by the few-rows kernels against the
tiles on the same panels, interleaved, per row count: the rows up to which
in place wins are what s16_panel_rows() (s16; PAGED_S16_PANEL_ROWS,
csrc_cpu/linear/s16.h) and nibble_panel_rows() (q4_1;
PAGED_NIBBLE_PANEL_ROWS, int8.h) should be on this CPU. With --engine, both
choices in an engine's decode steps of --streams rows on a GGUF file,
alternating round by round in one process.
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

SHAPES = [(2560, 2048), (2048, 2048), (11264, 2048), (2048, 5632)]
LAYOUTS = ["s16.u5", "s16.s6", "q4_1"]
WEIGHT_BYTES = 160 << 20  # per layout, past the L3


def weights(layout: str, seed: int) -> list:
    from paged.core.models.loaders.quant_layouts import pack_s16_codes

    gen = torch.Generator().manual_seed(seed)
    mats, total = [], 0
    while total < WEIGHT_BYTES:
        for n, k in SHAPES:
            if layout == "q4_1":
                qs = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8)
                d, m = torch.rand(n, k // 32, generator=gen) * 0.01, torch.randn(n, k // 32, generator=gen) * 0.01
                qtype = "q4_1"
            else:
                lo, hi = (0, 31) if layout == "s16.u5" else (-32, 31)
                qs, qtype = pack_s16_codes(torch.randint(lo, hi + 1, (n, k), generator=gen, dtype=torch.int8))
                d = torch.rand(n, k // 16, generator=gen) * 0.01
                m = torch.randn(n, k // 16, generator=gen) * 0.01 if layout == "s16.u5" else None
            mats.append((n, k, qtype, qs, d, m))
            total += qs.numel() + d.numel() * 4 + (m.numel() * 4 if m is not None else 0)
    return mats


def panels_of(mats: list) -> list:
    from paged import _C_cpu as C

    out = []
    for _, _, qtype, qs, d, m in mats:
        p = torch.empty(C.weight_panel_bytes(qtype, qs, d, m), dtype=torch.uint8)
        C.build_weight_panels(qtype, qs, d, m, p)
        out.append(p)
    return out


#: the two kernels of each panel layout as crossover settings: (s16_panel_rows, nibble_panel_rows)
IN_PLACE, TILES = (4096, 8), (8, 1)


def set_crossovers(rows) -> None:
    """Both layouts' crossovers: a pair as IN_PLACE / TILES, or 0 for the CPU's defaults."""
    from paged import _C_cpu as C

    s16, nibble = (rows, rows) if rows == 0 else rows
    C.set_s16_panel_rows(s16)
    C.set_nibble_panel_rows(nibble)


def best_times(mats: list, rows: int, rounds: int, activations: str, ways: list) -> list[float]:
    """Best seconds per way (panels or None, crossovers to set or 0 for the CPU's), passes interleaved."""
    from paged import _C_cpu as C

    x = {k: torch.randn(rows, k) for k in {k for _, k, *_ in mats}}
    out = {n: torch.empty(rows, n) for n in {n for n, *_ in mats}}
    best = [float("inf")] * len(ways)
    try:
        for _ in range(rounds):
            for i, (panels, panel_rows) in enumerate(ways):
                set_crossovers(panel_rows)
                t0 = time.perf_counter()
                for j, (n, k, qtype, qs, d, m) in enumerate(mats):
                    C.quant_linear(x[k], qtype, qs, d, m, out[n], activations, -1, None if panels is None else panels[j])
                best[i] = min(best[i], time.perf_counter() - t0)
    finally:
        set_crossovers(0)
    return best


def rate(mats: list, rows: int, rounds: int, activations: str, panels: list | None = None) -> dict:
    """Figures of the packed arrays, and with panels (given) of the panels too, passes interleaved."""
    best = best_times(mats, rows, rounds, activations, [(None, 0)] + ([(panels, 0)] if panels else []))
    flops = sum(2 * rows * n * k for n, k, *_ in mats)
    nbytes = sum(qs.numel() + d.numel() * 4 + (m.numel() * 4 if m is not None else 0) for _, _, _, qs, d, m in mats)
    fig = {"gflop_s": flops / best[0] / 1e9, "gb_s": nbytes / best[0] / 1e9}
    if panels:
        fig.update(panels_gflop_s=flops / best[1] / 1e9, panels_over_packed=best[0] / best[1])
    return fig


def crossover(mats: list, panels: list, rows: int, rounds: int, activations: str) -> dict:
    """The panels read in place (the few-rows kernel) against the tiles on them, same call, interleaved."""
    in_place, tiles = best_times(mats, rows, rounds, activations, [(panels, IN_PLACE), (panels, TILES)])
    flops = sum(2 * rows * n * k for n, k, *_ in mats)
    return {"in_place_gflop_s": flops / in_place / 1e9, "tiles_gflop_s": flops / tiles / 1e9,
            "in_place_over_tiles": tiles / in_place}


def engine_crossover(path: str, streams: int, rounds: int) -> dict:
    """One engine (2 threads pinned, auto activations) on a GGUF file, decode
    steps of `streams` rows, alternating panels read in place and the tiles
    round by round: output tok/s per round, and their ratio."""
    from paged import _C_cpu as C
    from paged.core.engine.config import EngineConfig
    from paged.core.engine.engine import Engine
    from paged.core.engine.sampling_params import SamplingParams

    cpus = sorted(os.sched_getaffinity(0))[:2]
    engine = Engine(EngineConfig(model=path, device="cpu", max_model_len=1024, kv_cache_memory="512MiB",
                                 max_num_seqs=streams, itl_target_ms=None, cpu_threads_bind=",".join(map(str, cpus))))
    ways = {"in_place": IN_PLACE, "tiles": TILES}
    tok_s = {w: [] for w in ways}
    try:
        for i in range(streams):
            engine.add_request(f"s{i}", [5 + i, 6, 7, 8, 9 + i],
                               SamplingParams(max_tokens=10**4, ignore_eos=True, temperature=0.0))
        for _ in range(4):
            engine.step()  # the prompts, then decode steps of `streams` rows
        for r in range(2 * rounds):
            for w in ways if r % 2 == 0 else reversed(list(ways)):
                set_crossovers(ways[w])
                engine.step()
                t0 = time.perf_counter()
                for _ in range(4):
                    engine.step()
                tok_s[w].append(streams * 4 / (time.perf_counter() - t0))
    finally:
        set_crossovers(0)
        engine.close()
    return {"tok_s": tok_s, "in_place_over_tiles": {
        "best": max(tok_s["in_place"]) / max(tok_s["tiles"]),
        "median": statistics.median(tok_s["in_place"]) / statistics.median(tok_s["tiles"])}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=positive_int, nargs="+", default=[1, 2, 4, 8, 9, 16, 64, 128])
    ap.add_argument("--activations", choices=["int8x2", "int8"], default="int8x2")
    ap.add_argument("--threads", type=positive_int, default=2)
    ap.add_argument("--rounds", type=positive_int, default=5)
    ap.add_argument("--panels", action="store_true", help="also time each layout with its persistent panels")
    ap.add_argument("--crossover", action="store_true",
                    help="panels read in place (few-rows kernels) against the tiles, per row count: where "
                         "PAGED_S16_PANEL_ROWS (s16) and PAGED_NIBBLE_PANEL_ROWS (q4_1) should lie on this CPU")
    ap.add_argument("--engine", metavar="GGUF",
                    help="with --crossover: also an engine's decode steps on this file, --streams rows each")
    ap.add_argument("--streams", type=positive_int, nargs="+", default=[16, 32])
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from paged import _C_cpu as C

    print(f"s16 kernel by rows: {C.linear_isa()} build, {args.activations}, {args.threads} threads, "
          f"best of {args.rounds}", flush=True)
    if (args.panels or args.crossover) and not C.weight_panel_layout():
        print(f"--panels / --crossover: linear ISA {C.linear_isa()!r} has no weight panels", file=sys.stderr)
        return 2
    if args.crossover:
        print(f"CPU {C.cpu_vendor() or '?'}: panels read in place up to {C.s16_panel_rows()} rows (s16), "
              f"{C.nibble_panel_rows()} (q4_1) now", flush=True)
        figures = {}
        for i, layout in enumerate(LAYOUTS):
            mats = weights(layout, seed=i)
            panels = panels_of(mats)
            figures[layout] = {}
            for rows in args.rows:
                figures[layout][rows] = r = crossover(mats, panels, rows, args.rounds, args.activations)
                print(f"{layout:7s} M={rows:4d}: in place {r['in_place_gflop_s']:6.1f} GFLOP/s, tiles "
                      f"{r['tiles_gflop_s']:6.1f} ({r['in_place_over_tiles']:.2f}x)", flush=True)
            del mats, panels
        engine = {}
        for streams in args.streams if args.engine else []:
            engine[streams] = e = engine_crossover(args.engine, streams, args.rounds)
            print(f"engine, {streams} streams: in place {max(e['tok_s']['in_place']):.1f}, tiles "
                  f"{max(e['tok_s']['tiles']):.1f} output tok/s (best; in place / tiles best "
                  f"{e['in_place_over_tiles']['best']:.2f}x, median {e['in_place_over_tiles']['median']:.2f}x)",
                  flush=True)
        emit_json({"threads": args.threads, "isa": C.linear_isa(), "activations": args.activations,
                   "cpu_vendor": C.cpu_vendor(), "s16_panel_rows": C.s16_panel_rows(),
                   "nibble_panel_rows": C.nibble_panel_rows(), "crossover": figures,
                   "engine": {"file": args.engine, "streams": engine} if args.engine else None}, args.json)
        return 0
    figures = {}
    for i, layout in enumerate(LAYOUTS):
        mats = weights(layout, seed=i)
        panels = panels_of(mats) if args.panels else None
        figures[layout] = {}
        for rows in args.rows:
            figures[layout][rows] = r = rate(mats, rows, args.rounds, args.activations, panels)
            line = f"{layout:7s} M={rows:4d}: {r['gflop_s']:6.1f} GFLOP/s  {r['gb_s']:5.1f} GB/s"
            if panels:
                line += f"   panels {r['panels_gflop_s']:6.1f} GFLOP/s ({r['panels_over_packed']:.2f}x)"
            print(line, flush=True)
        del mats, panels
    emit_json({"threads": args.threads, "isa": C.linear_isa(), "activations": args.activations, "figures": figures},
              args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
