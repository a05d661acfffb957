"""Single-stream decode under CPU contention: the default binding
(--cpu-threads-bind auto) alone, and with a CPU hog pinned to one of its
cores, started before the engine or while it runs. Conditions alternate,
each run in a fresh process with a fresh engine.

    python benchmarks/cpu_contention.py [--rounds 3] [--tokens 128] [--hog-cpu N]
                                        [--binds auto[,0-1,...]] [--nice N] [--json PATH]

Figure: decode tok/s = 1 / median gap between consecutive tokens of one
greedy request (EOS ignored), the median over --repeats requests, after one
request of warm-up (and of settling, once a hog starts mid-run: the engine
looks at CPU load about once a second). ratio = tok/s / tok/s alone, both
medians over the rounds; best ratio = the same with the best round of each
(on a shared machine the figure least distorted by other processes). An explicit CPU list (e.g. 0-1) pins without
adapting: what auto did before it watched the load. --nice -20 (as root)
runs engine and hog alike ahead of the rest of a shared machine: each
worker is a session of its own, and its niceness is also set on the
session's scheduler group, since with autogroup scheduling (Linux's
default) niceness only ranks processes within one session.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from timing import emit_json

CONDITIONS = ("alone", "hog before start", "hog while running")
PROMPT = "The history of the city begins"


def start_hog(cpu: int) -> subprocess.Popen:
    """A busy loop pinned to ``cpu`` (a separate process, as another job would be)."""
    code = f"import os\nos.sched_setaffinity(0, {{{cpu}}})\nwhile True:\n    pass\n"
    return subprocess.Popen([sys.executable, "-c", code])


def set_niceness(nice: int) -> None:
    """This process, and all it starts, at ``nice``, its session's group too."""
    os.setpriority(os.PRIO_PROCESS, 0, nice)
    try:
        with open("/proc/self/autogroup", "w") as f:
            f.write(str(nice))
    except OSError:
        pass  # no autogroup scheduling in this kernel


def decode_rate(llm, params) -> float:
    stamps: list[float] = []
    llm.generate(PROMPT, params, on_output=lambda _: stamps.append(time.perf_counter()))
    return 1.0 / statistics.median(b - a for a, b in zip(stamps, stamps[1:]))


def worker(args) -> dict:
    """One measurement in this process: a fresh engine under one condition."""
    from paged.core.entrypoints.llm import LLM
    from paged.core.engine.sampling_params import SamplingParams

    if args.nice:
        set_niceness(args.nice)
    hog = start_hog(args.hog_cpu) if args.condition == "hog before start" else None
    try:
        llm = LLM(device="cpu", cpu_threads_bind=args.bind, max_model_len=512, kv_cache_memory="64MiB")
        params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
        decode_rate(llm, params)  # warm-up
        if args.condition == "hog while running":
            hog = start_hog(args.hog_cpu)
            decode_rate(llm, params)  # settle
        rates = [decode_rate(llm, params) for _ in range(args.repeats)]
        threads = len(llm.engine.platform.plan.cpus) if llm.engine.platform.plan else 0
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()
    return {"bind": args.bind, "condition": args.condition, "tok_s": statistics.median(rates),
            "threads_at_end": threads}


def run_worker(args, bind: str, condition: str) -> dict:
    cmd = [sys.executable, __file__, "--worker", "--bind", bind, "--condition", condition,
           "--hog-cpu", str(args.hog_cpu), "--tokens", str(args.tokens), "--repeats", str(args.repeats),
           "--nice", str(args.nice)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False, start_new_session=True)
    if out.returncode != 0:
        raise SystemExit(f"worker failed ({bind}, {condition}):\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def summarize(results: list[dict]) -> list[dict]:
    rows = []
    for bind in dict.fromkeys(r["bind"] for r in results):
        alone = [r["tok_s"] for r in results if r["bind"] == bind and r["condition"] == "alone"]
        for condition in CONDITIONS:
            runs = [r for r in results if r["bind"] == bind and r["condition"] == condition]
            rates = [r["tok_s"] for r in runs]
            rows.append({"bind": bind, "condition": condition, "tok_s": round(statistics.median(rates), 1),
                         "ratio": round(statistics.median(rates) / statistics.median(alone), 2),
                         "best_ratio": round(max(rates) / max(alone), 2), "runs": [round(t, 1) for t in rates],
                         "threads_at_end": [r["threads_at_end"] for r in runs]})
    return rows


def cpu_model() -> str:
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=128, help="tokens per request")
    p.add_argument("--repeats", type=int, default=3, help="timed requests per run")
    p.add_argument("--hog-cpu", type=int, default=max(os.sched_getaffinity(0)),
                   help="the CPU the hog is pinned to (default: the highest allowed)")
    p.add_argument("--binds", default="auto", help="comma-separated --cpu-threads-bind values")
    p.add_argument("--nice", type=int, default=0,
                   help="niceness of the engine and the hog alike, and of their session (default: 0)")
    p.add_argument("--json", nargs="?", const="", default=None, help="also print (and write to PATH) JSON")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--bind", default="auto", help=argparse.SUPPRESS)
    p.add_argument("--condition", choices=CONDITIONS, default="alone", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return
    results = [run_worker(args, bind, condition)
               for _ in range(args.rounds) for bind in args.binds.split(",") for condition in CONDITIONS]
    rows = summarize(results)
    print(f"cpu: {cpu_model()}, {os.cpu_count()} CPUs; hog pinned to CPU {args.hog_cpu}; nice {args.nice}; "
          f"{args.rounds} rounds x {args.repeats} requests of {args.tokens} tokens")
    print(f"{'bind':<8}{'condition':<20}{'tok/s':>8}{'ratio':>7}{'best ratio':>12}  runs (threads at end)")
    for r in rows:
        runs = ", ".join(f"{t} ({n})" for t, n in zip(r["runs"], r["threads_at_end"]))
        print(f"{r['bind']:<8}{r['condition']:<20}{r['tok_s']:>8}{r['ratio']:>7}{r['best_ratio']:>12}  {runs}")
    if args.json is not None:
        emit_json({"cpu": cpu_model(), "hog_cpu": args.hog_cpu, "nice": args.nice, "tokens": args.tokens,
                   "rows": rows},
                  args.json or None)


if __name__ == "__main__":
    main()
