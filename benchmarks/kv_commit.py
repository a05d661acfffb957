"""How the CPU KV cache commits its memory, side by side: engine start-up
time, RSS, and the engine's step times while requests walk into fresh KV
blocks, for each of CpuBackend.kv_commit's modes (docs/block-pool.md, "KV
memory on the CPU"):

    prefault   pages committed ahead of use by the arena's background thread (the default)
    on-demand  each page faulted in by the step that first writes it
    all        everything committed before the engine starts (the cache before #46)

    .venv/bin/python benchmarks/kv_commit.py [--modes prefault,on-demand,all] [--rounds 2]
        [--num-seqs 64] [--input-len 256] [--output-len 32] [--no-engine]
        [--write-steps] [--write-gib 1] [--write-blocks 4] [--write-work 40] [--json PATH]

Engine part: each (round, mode) runs in a fresh process (RSS is per
process) with the engine's defaults (the default model, the default KV
budget), submits ``--num-seqs`` random prompts at once and times every
engine.step() until they finish. "fresh" steps are those that wrote a block
past every block written before (the ones that may meet an uncommitted page).

Write part (``--write-steps``, the page faults without the model's noise):
the default model's KV shape (30 layers, 3 KV heads of 64, 128-token
float16 blocks) over ``--write-gib``; each step tells the cache its highest
block (as the engine does), writes ``--write-blocks`` fresh blocks into every
layer with the CPU reshape_and_cache kernel, then does a fixed amount of
matrix work on the thread team standing in for the model. The step time is
the figure: on-demand pays the faults inside it, prefault moves them to the
background thread (which competes for the same cores), all paid them at
start. The page faults the step's threads take (/proc minflt, the pre-faulter's
own excluded) are the figure the machine's load does not blur.

Figures are medians over rounds; on a shared machine the ratios are the result.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from timing import emit_json, positive_int

MODES = ("prefault", "on-demand", "all")


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return -1


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run_mode(mode: str, num_seqs: int, input_len: int, output_len: int) -> dict:
    """One engine in this process with kv_commit = ``mode``: its start-up and step figures."""
    from offline_throughput import make_prompts

    from paged.backends.cpu.attention import CpuBackend
    from paged.core.engine.config import EngineConfig
    from paged.core.engine.engine import Engine
    from paged.core.engine.sampling_params import SamplingParams

    CpuBackend.kv_commit = mode
    t0 = time.perf_counter()
    engine = Engine(EngineConfig(device="cpu"))
    startup_s = time.perf_counter() - t0
    memory = engine.attn_backend.kv_memory
    report = {"mode": mode, "startup_s": startup_s, "rss_after_start_bytes": rss_bytes(),
              "kv_reserved_bytes": memory.reserved_bytes, "kv_committed_after_start_bytes": memory.committed_bytes(),
              "num_blocks": engine.kv_cache_manager.num_blocks, "block_size": engine.block_size}
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(make_prompts(num_seqs, input_len, engine.model_config.vocab_size, seed=1)):
        engine.add_request(f"r{i}", prompt, params)
    steps, fresh = [], []
    while engine.has_unfinished_requests():
        before = memory.highest_written
        t = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t)
        if memory.highest_written > before:
            fresh.append(steps[-1])
    report.update(steps=len(steps), step_ms_mean=1e3 * statistics.fmean(steps),
                  step_ms_p90=1e3 * percentile(steps, 0.9), step_ms_max=1e3 * max(steps),
                  fresh_steps=len(fresh), fresh_step_ms_mean=1e3 * statistics.fmean(fresh) if fresh else 0.0,
                  run_s=sum(steps), highest_block=memory.highest_written,
                  rss_after_run_bytes=rss_bytes(), kv_committed_after_run_bytes=memory.committed_bytes())
    return report


def minor_faults(tids) -> int:
    """Minor page faults the threads ``tids`` of this process have taken."""
    total = 0
    for tid in tids:
        with open(f"/proc/self/task/{tid}/stat") as f:
            total += int(f.read().rsplit(")", 1)[1].split()[7])  # field 10, minflt
    return total


def write_steps(mode: str, gib: float, new_blocks: int, work: int) -> dict:
    """Step times writing ``new_blocks`` fresh blocks a step into a KV cache of ``gib`` GiB."""
    import torch

    from paged.backends.cpu.attention import CpuBackend

    CpuBackend.kv_commit = mode
    layers, heads, head, bs = 30, 3, 64, 128
    backend = CpuBackend(9, heads, head, bs, torch.float32, torch.device("cpu"), kv_cache_dtype=torch.float16)
    num_blocks = int(gib * 2**30) // backend.bytes_per_block(layers)
    t0 = time.perf_counter()
    caches = backend.allocate_kv_cache(layers, num_blocks)
    allocate_s = time.perf_counter() - t0
    kv = backend.kv_memory
    tokens = new_blocks * bs
    key, value = torch.randn(tokens, heads, head), torch.randn(tokens, heads, head)
    a = torch.randn(256, 256)
    # The step's threads: this one and its OpenMP team (made by a first write,
    # to block 0); the pre-faulter, started by the first kv.written, is not one.
    backend.reshape_and_cache(key[:1], value[:1], caches[0][0], caches[0][1], torch.zeros(1, dtype=torch.int64))
    step_threads = [int(t) for t in os.listdir("/proc/self/task")]
    faults_before = minor_faults(step_threads)
    steps, writes = [], []
    for first in range(0, num_blocks - new_blocks + 1, new_blocks):
        slots = torch.arange(first * bs, (first + new_blocks) * bs, dtype=torch.int64)
        t = time.perf_counter()
        kv.written(first + new_blocks - 1)  # what build_metadata does at the start of a step
        for k_cache, v_cache in caches:
            backend.reshape_and_cache(key, value, k_cache, v_cache, slots)
        writes.append(time.perf_counter() - t)
        for _ in range(work):  # the model's share of the step
            a = torch.tanh(a @ a)
        steps.append(time.perf_counter() - t)
    return {"mode": mode, "allocate_s": allocate_s, "num_blocks": num_blocks, "steps": len(steps),
            "step_ms_mean": 1e3 * statistics.fmean(steps), "step_ms_p90": 1e3 * percentile(steps, 0.9),
            "step_ms_max": 1e3 * max(steps), "write_ms_mean": 1e3 * statistics.fmean(writes),
            "write_ms_p90": 1e3 * percentile(writes, 0.9), "write_ms_max": 1e3 * max(writes),
            "step_thread_faults": minor_faults(step_threads) - faults_before,
            "committed_bytes": kv.committed_bytes()}


def compare_writes(modes: list[str], args) -> dict:
    """The write part, alternating modes for ``args.rounds`` rounds in this process."""
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    write_steps("all", min(args.write_gib, 0.1), args.write_blocks, args.write_work)  # the process's first-use faults
    for r in range(args.rounds):
        for m in modes:
            rep = write_steps(m, args.write_gib, args.write_blocks, args.write_work)
            runs[m].append(rep)
            print(f"writes round {r + 1} {m:9s}: allocate {rep['allocate_s']:5.2f} s; {rep['steps']} steps, mean "
                  f"{rep['step_ms_mean']:6.2f} ms (writing {rep['write_ms_mean']:6.2f} ms, max "
                  f"{rep['write_ms_max']:6.2f} ms), p90 {rep['step_ms_p90']:6.2f} ms; "
                  f"{rep['step_thread_faults']} page faults in the step's threads", flush=True)
    base = modes[0]
    summary = {m: {k: statistics.median(rep[k] for rep in runs[m])
                   for k in ("allocate_s", "step_ms_mean", "step_ms_p90", "step_ms_max", "write_ms_mean",
                             "write_ms_p90", "write_ms_max", "step_thread_faults")} for m in modes}
    print(f"\nwrites: {args.write_blocks} fresh blocks a step into {args.write_gib} GiB, medians of {args.rounds}; "
          f"ratios against {base}")
    for m in modes:
        s = summary[m]
        print(f"{m:10s} allocate {s['allocate_s']:6.2f} s  step mean {s['step_ms_mean']:7.2f} ms "
              f"({s['step_ms_mean'] / summary[base]['step_ms_mean']:.2f}x)  writing mean {s['write_ms_mean']:6.2f} ms "
              f"({s['write_ms_mean'] / summary[base]['write_ms_mean']:.2f}x), p90 {s['write_ms_p90']:6.2f} ms, "
              f"max {s['write_ms_max']:7.2f} ms; {s['step_thread_faults']:.0f} faults in steps")
    return {"write_gib": args.write_gib, "write_blocks": args.write_blocks, "write_work": args.write_work,
            "summary": summary, "runs": runs}


def child(args) -> dict:
    """Runs one mode in a fresh interpreter and returns its report."""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", args.mode_for_child,
           "--num-seqs", str(args.num_seqs), "--input-len", str(args.input_len),
           "--output-len", str(args.output_len)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", default=",".join(MODES), help="comma separated: " + ", ".join(MODES))
    ap.add_argument("--rounds", type=positive_int, default=2)
    ap.add_argument("--num-seqs", type=positive_int, default=64)
    ap.add_argument("--input-len", type=positive_int, default=256)
    ap.add_argument("--output-len", type=positive_int, default=32)
    ap.add_argument("--write-steps", action="store_true", help="also run the write part")
    ap.add_argument("--engine", action=argparse.BooleanOptionalAction, default=True,
                    help="run the engine part (default: yes)")
    ap.add_argument("--write-gib", type=float, default=1.0)
    ap.add_argument("--write-blocks", type=positive_int, default=4, help="fresh blocks a step")
    ap.add_argument("--write-work", type=positive_int, default=40, help="256x256 matmuls a step")
    ap.add_argument("--json", default=None, metavar="PATH")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(run_mode(args.child, args.num_seqs, args.input_len, args.output_len)))
        return {}
    modes = [m for m in args.modes.split(",") if m]
    if not modes or any(m not in MODES for m in modes):
        ap.error(f"--modes: expected a comma separated subset of {', '.join(MODES)}, got {args.modes!r}")
    report = {"num_seqs": args.num_seqs, "input_len": args.input_len, "output_len": args.output_len,
              "rounds": args.rounds}
    if args.write_steps:
        report["writes"] = compare_writes(modes, args)
    if args.engine:
        report["engine"] = compare_engines(modes, args)
    emit_json(report, args.json)
    return report


def compare_engines(modes: list[str], args) -> dict:
    """The engine part: each (round, mode) in a fresh process, alternating modes."""
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    for r in range(args.rounds):
        for m in modes:  # alternating, so drift in the machine's load hits every mode alike
            args.mode_for_child = m
            rep = child(args)
            runs[m].append(rep)
            print(f"round {r + 1} {m:9s}: start {rep['startup_s']:5.2f} s, RSS {rep['rss_after_start_bytes'] / 2**30:.2f}"
                  f" GiB; steps mean {rep['step_ms_mean']:6.1f} ms, fresh {rep['fresh_step_ms_mean']:6.1f} ms, "
                  f"p90 {rep['step_ms_p90']:6.1f} ms, max {rep['step_ms_max']:6.1f} ms", flush=True)

    def med(m, key):
        return statistics.median(rep[key] for rep in runs[m])

    base = modes[0]
    print(f"\n{args.num_seqs} sequences x {args.input_len} prompt + {args.output_len} new tokens; medians of "
          f"{args.rounds} round(s); ratios against {base}")
    print(f"{'mode':10s} {'start s':>8s} {'RSS GiB':>8s} {'step ms':>8s} {'fresh ms':>9s} {'p90 ms':>7s} "
          f"{'max ms':>7s} {'run s':>6s}  (step, fresh, run vs {base})")
    summary = {}
    for m in modes:
        s = {k: med(m, k) for k in ("startup_s", "rss_after_start_bytes", "step_ms_mean", "fresh_step_ms_mean",
                                     "step_ms_p90", "step_ms_max", "run_s", "rss_after_run_bytes",
                                     "kv_committed_after_start_bytes", "kv_committed_after_run_bytes")}
        summary[m] = s
        print(f"{m:10s} {s['startup_s']:8.2f} {s['rss_after_start_bytes'] / 2**30:8.2f} {s['step_ms_mean']:8.1f} "
              f"{s['fresh_step_ms_mean']:9.1f} {s['step_ms_p90']:7.1f} {s['step_ms_max']:7.1f} {s['run_s']:6.2f}  "
              f"({s['step_ms_mean'] / summary[base]['step_ms_mean']:.2f}x, "
              f"{s['fresh_step_ms_mean'] / max(summary[base]['fresh_step_ms_mean'], 1e-9):.2f}x, "
              f"{s['run_s'] / summary[base]['run_s']:.2f}x)")
    return {"summary": summary, "runs": runs}


if __name__ == "__main__":
    main()
