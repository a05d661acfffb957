"""The MoE step of another commit beside this tree's, interleaved in one
process on one engine (so both see the same machine load), on
benchmarks/moe.py's model files:

    git show bc34d22:core/models/moe.py > /tmp/old_moe.py
    python benchmarks/moe_step_paired.py --old /tmp/old_moe.py /tmp/moe1b/*.gguf [--json PATH]

Per file and stream count (1, 4, 16; --rounds rounds each, best kept),
on the Python layers (PAGED_LAYER_STACK=0: the layer stack runs its MoE
layers without MoeMlp.__call__), decode tok/s with MoeMlp.__call__ taken from --old ("before"), this tree's
torch-op path with the one-call experts switched off ("torch_ops") and
this tree as it runs ("after": on the CPU one extension call per layer,
csrc_cpu/model/moe_experts.h). One engine thread pinned to the first CPU.
The old step must take the MoeMlp attributes this tree builds (true back to
the MoE block's first commit).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from timing import emit_json, positive_int  # noqa: E402


def _decode(engine, streams: int, tokens: int, tag: str) -> float:
    from paged.core.engine.sampling_params import SamplingParams

    for i in range(streams):
        engine.add_request(f"{tag}{i}", [5 + i, 6, 7, 8 + i],
                           SamplingParams(max_tokens=tokens + 1, ignore_eos=True, temperature=0.0))
    started: set[str] = set()
    while len(started) < streams:  # every prompt prefilled, its first token out
        started.update(o.request_id for o in engine.step() if o.outputs and o.outputs[0].token_ids)
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return streams * tokens / (time.perf_counter() - t0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+")
    ap.add_argument("--old", required=True, metavar="PATH", help="another commit's core/models/moe.py")
    ap.add_argument("--rounds", type=positive_int, default=2)
    ap.add_argument("--decode-tokens", type=positive_int, default=32)
    ap.add_argument("--json", default=None, metavar="PATH")
    args = ap.parse_args()

    # the Python layers' MoE step: the C++ layer stack runs routing and experts
    # itself (MoeExperts.forward), never calling the MoeMlp.__call__ swapped in below
    os.environ["PAGED_LAYER_STACK"] = "0"
    from paged.core.engine.config import EngineConfig
    from paged.core.engine.engine import Engine
    from paged.core.models import moe

    spec = importlib.util.spec_from_file_location("old_moe", args.old)
    old = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(old)
    call, fused = moe.MoeMlp.__call__, moe.MoeMlp._fused_experts
    variants = {"before": (old.MoeMlp.__call__, lambda self, ops: None),
                "torch_ops": (call, lambda self, ops: None), "after": (call, fused)}
    report = {"old": args.old, "rounds": args.rounds, "decode_tokens": args.decode_tokens,
              "load_average": os.getloadavg(), "files": {}}
    for path in args.files:
        engine = Engine(EngineConfig(model=path, device="cpu", max_model_len=1024, kv_cache_memory="256MiB",
                                     max_num_seqs=16, max_num_batched_tokens=256, itl_target_ms=None,
                                     cpu_threads_bind=str(min(os.sched_getaffinity(0)))))
        got: dict[str, dict[str, float]] = {}
        try:
            for streams in (1, 4, 16):
                runs: dict[str, list[float]] = {}
                for r in range(args.rounds):
                    for name, (step, one_call) in variants.items():
                        moe.MoeMlp.__call__, moe.MoeMlp._fused_experts = step, one_call
                        runs.setdefault(name, []).append(_decode(engine, streams, args.decode_tokens,
                                                                 f"{name}{streams}-{r}-"))
                best = got[f"{streams}_streams_tok_s"] = {k: max(v) for k, v in runs.items()}
                print(f"{os.path.basename(path)} {streams} streams: " + ", ".join(
                    f"{k} {v:.2f}" for k, v in best.items()) + f" tok/s; after/before "
                      f"{best['after'] / best['before']:.2f}x", flush=True)
        finally:
            moe.MoeMlp.__call__, moe.MoeMlp._fused_experts = call, fused
            engine.close()
        report["files"][os.path.basename(path)] = got
    report["load_average_after"] = os.getloadavg()
    emit_json(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
