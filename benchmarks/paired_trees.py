"""Two source trees of paged beside each other on the default model: the same
greedy tokens and logprobs (bitwise), and the ratio of their decode step and
serving throughput over paired, interleaved rounds.

    .venv/bin/python benchmarks/paired_trees.py --old /tmp/old44pkg [--new DIR] [--rounds 5]
                                                 [--json PATH]

A tree is a folder laid out as installed (``paged/`` with core, backends,
platforms and the built extensions: see ``--help`` of --old); None (--new's
default) is this interpreter's own install. Each round runs one fresh process
per tree, alternating which goes first, so a neighbour's load on a shared
machine falls on both; figures are the medians of the per-round ratios
new / old.

Per process (``--probe``), the engine as ``paged generate`` builds it:

- bits: 4 prompts, greedy, 24 tokens each with the chosen token's logprob;
- decode step: one sequence, (time of 33 tokens - time of 1) / 32, best of 5;
- serving: 8 sequences of 64 prompt tokens, 32 tokens each, batched: output
  tokens per second, best of 2 (the engine's step loop as the server drives
  it, without HTTP).

Both trees' engines pin their threads to the CPUs ``PAGED_BENCH_CPUS`` lists
(default 0: one thread, which a busy neighbour slows but never stalls at a
barrier; with two threads on a loaded machine one straggler stalls every
step, and rounds varied 14x).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "List three colors:"]


TREE = "PAGED_BENCH_TREE"  # the probe's tree, handed to the child process


def use_tree(tree: str) -> None:
    """Import paged from ``tree``: before anything imports it, drop the
    editable install's redirecting finder and put the tree first."""
    sys.meta_path[:] = [f for f in sys.meta_path if type(f).__name__ != "ScikitBuildRedirectingFinder"]
    sys.path.insert(0, tree)


def probe() -> dict:
    """Runs in the tree under test: its figures and bits as one JSON object."""
    import random

    import paged

    print(f"paged from {os.path.dirname(paged.__file__)}", file=sys.stderr)
    try:
        from paged.core.engine.config import EngineConfig
        from paged.core.engine.engine import Engine
        from paged.core.engine.sampling_params import SamplingParams
        from paged.core.entrypoints.llm import LLM
    except ImportError:  # a tree from before the layout move (#42)
        from paged.core.engine import Engine
        from paged.core.engine_config import EngineConfig
        from paged.core.llm import LLM
        from paged.core.sampling_params import SamplingParams

    # both trees on the same CPUs: auto binding drops a CPU a neighbour keeps busy, which
    # would make the trees' thread counts differ from round to round
    engine = Engine(EngineConfig(device="cpu", max_model_len=256, max_num_seqs=8, enable_prefix_caching=False,
                                 kv_cache_memory="512MiB", cpu_threads_bind=os.environ.get("PAGED_BENCH_CPUS", "0")))
    llm = LLM.from_engine(engine)
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=1)
    outs = llm.generate(PROMPTS, greedy)
    bits = [[o.outputs[0].token_ids, [lp[t].hex() for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]]
            for o in outs]

    def timed(prompts, n):
        t0 = time.perf_counter()
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
        return time.perf_counter() - t0

    one = [PROMPTS[0]]
    timed(one, 8)  # first-use costs
    # best of several: the figure least distorted by neighbours on a shared machine
    step = min((timed(one, 33) - timed(one, 1)) / 32 for _ in range(5))
    rng = random.Random(0)
    batch = [[rng.randrange(100, 20000) for _ in range(64)] for _ in range(8)]
    timed(batch[:2], 4)
    wall = min(timed(batch, 32) for _ in range(2))
    return {"bits": bits, "decode_step_ms": step * 1e3, "serving_out_tok_s": 8 * 32 / wall}


def run_tree(tree: str | None) -> dict:
    env = dict(os.environ)
    env.pop(TREE, None)
    if tree:
        env[TREE] = tree
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--probe"], env=env, capture_output=True,
                         text=True, cwd="/")
    if out.returncode:
        raise SystemExit(f"tree {tree or 'this install'}: probe failed\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _cpu_name() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", help="the old tree: a folder holding paged/ as installed (paged/__init__.py from "
                                  "core/_root/paged, paged/core, paged/backends, paged/platforms, and the "
                                  "built _C_*.so)")
    ap.add_argument("--new", default=None, help="the new tree, likewise (default: this interpreter's install)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default=None, help="write the rounds here in docs/results.md's format")
    ap.add_argument("--old-commit", default=None, help="the old tree's commit, for the record")
    ap.add_argument("--new-commit", default=None, help="the new tree's commit, for the record")
    ap.add_argument("--notes", default="", help="conditions of the run, for the record")
    ap.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.probe:
        if os.environ.get(TREE):
            use_tree(os.environ[TREE])
        print(json.dumps(probe()))
        return 0
    if not args.old:
        ap.error("--old: expected a folder, got none")
    rounds = []
    for r in range(args.rounds):
        order = ("old", "new") if r % 2 == 0 else ("new", "old")
        got = {name: run_tree(args.old if name == "old" else args.new) for name in order}
        ratio = {k: got["new"][k] / got["old"][k] for k in ("decode_step_ms", "serving_out_tok_s")}
        same = got["new"]["bits"] == got["old"]["bits"]
        rounds.append({"order": order, "old": {k: v for k, v in got["old"].items() if k != "bits"},
                       "new": {k: v for k, v in got["new"].items() if k != "bits"}, "ratio": ratio,
                       "bitwise_equal": same})
        print(f"round {r + 1} ({order[0]} first): decode step {got['old']['decode_step_ms']:.2f} -> "
              f"{got['new']['decode_step_ms']:.2f} ms (x{ratio['decode_step_ms']:.3f}), serving "
              f"{got['old']['serving_out_tok_s']:.1f} -> {got['new']['serving_out_tok_s']:.1f} tok/s "
              f"(x{ratio['serving_out_tok_s']:.3f}), tokens and logprobs {'equal' if same else 'DIFFER'}",
              flush=True)
    summary = {"rounds": rounds,
               "median_ratio_decode_step_ms": statistics.median(r["ratio"]["decode_step_ms"] for r in rounds),
               "median_ratio_serving_out_tok_s": statistics.median(r["ratio"]["serving_out_tok_s"] for r in rounds),
               "bitwise_equal_every_round": all(r["bitwise_equal"] for r in rounds)}
    print(f"median new/old: decode step x{summary['median_ratio_decode_step_ms']:.3f} (lower is faster), serving "
          f"x{summary['median_ratio_serving_out_tok_s']:.3f} (higher is faster); bitwise equal: "
          f"{summary['bitwise_equal_every_round']}")
    if args.json:  # docs/results.md's format
        import datetime
        import platform

        record = {"date": datetime.date.today().isoformat(), "command": " ".join(["python"] + sys.argv),
                  "cpu": _cpu_name() or platform.processor(), "commit": args.new_commit,
                  "figures": {"old_commit": args.old_commit, **summary}, "notes": args.notes}
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
