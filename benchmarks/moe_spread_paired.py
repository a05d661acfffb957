"""The CPU MoE experts' two schedules interleaved on one engine (both see
the same machine load), on benchmarks/moe.py's model files:

    python benchmarks/moe_spread_paired.py /tmp/moe1b/qwen3moe-1b-Q4_0.gguf [--rounds 3] [--json PATH]

"before": each expert matrix's int8 call splits its own weight rows over
the threads (a parallel region per expert matrix, MoeExperts.spread_experts
False); "after": one region per layer and matrix kind spreads the chosen
experts over the threads (the default). Same bits (tests/test_moe.py).
Batch-1 decode (32 tokens) and 16-stream decode (8 steps) tok/s per round,
2 threads pinned, best-of ratios.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import moe as bench  # noqa: E402
from timing import emit_json, positive_int  # noqa: E402


def measure(path: str, rounds: int) -> dict:
    from paged.core.engine.config import EngineConfig
    from paged.core.engine.engine import Engine

    cpus = sorted(os.sched_getaffinity(0))[:2]
    engine = Engine(EngineConfig(model=path, device="cpu", max_model_len=1024, kv_cache_memory="256MiB",
                                 max_num_seqs=16, max_num_batched_tokens=256, itl_target_ms=None,
                                 cpu_threads_bind=",".join(map(str, cpus))))
    model = engine.runner.model
    bench._decode(engine, model, 1, 4, "warm")  # builds each layer's one-call experts
    natives = [layer.moe._fused._native for layer in model.layers if layer.moe is not None]
    runs = {"before": {"batch1": [], "streams16": []}, "after": {"batch1": [], "streams16": []}}
    for r in range(rounds):
        for name, spread in (("before", False), ("after", True)):
            for native in natives:
                native.spread_experts = spread
            runs[name]["batch1"].append(bench._decode(engine, model, 1, 32, f"b{r}{name}")["tok_s"])
            runs[name]["streams16"].append(bench._decode(engine, model, 16, 8, f"s{r}{name}")["tok_s"])
    engine.close()
    ratios = {k: max(runs["after"][k]) / max(runs["before"][k]) for k in ("batch1", "streams16")}
    return {"tok_s": runs, "best_ratio": ratios, "load_average": os.getloadavg()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="+")
    p.add_argument("--rounds", type=positive_int, default=3)
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args()
    report = {"files": {}}
    for path in args.files:
        out = report["files"][os.path.basename(path)] = measure(path, args.rounds)
        print(f"{os.path.basename(path)}: after/before best batch 1 {out['best_ratio']['batch1']:.2f}x, "
              f"16 streams {out['best_ratio']['streams16']:.2f}x (load {out['load_average'][0]:.1f})", flush=True)
    emit_json(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
