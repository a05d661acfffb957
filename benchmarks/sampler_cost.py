"""The sampler's cost per step, another commit's beside this tree's,
interleaved in one process:

    git show 0ef5575:core/engine/sampler.py > /tmp/old_sampler.py
    python benchmarks/sampler_cost.py --old /tmp/old_sampler.py [--json PATH]

Per vocabulary size (SmolLM2's 49152, Llama 3's 128256, Qwen's 151936),
rows (1 and 16 sequences sampling in one step), settings (temperature
alone; top_p 0.9; top_k 40 with top_p 0.95; a repetition penalty; presence
and frequency penalties, each sequence 1000 prompt and 200 output tokens)
and logit spread (peaked:
N(0, 6^2) logits, a few tokens hold most of the mass as in a model's
usual step; flat: N(0, 1), a nucleus of most of the vocabulary), the best
milliseconds of a sampler call for the old module and this tree's, and
their ratio. Greedy rows cost the same in both (one argmax) and are left
out. At 1B a decode step is ~20 ms: the sampler's share is what matters.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from timing import best_time, emit_json  # noqa: E402

VOCABS = (49152, 128256, 151936)
SETTINGS = {
    "temperature 0.8": dict(temperature=0.8),
    "top_p 0.9": dict(temperature=0.8, top_p=0.9),
    "top_k 40 top_p 0.95": dict(temperature=0.8, top_k=40, top_p=0.95),
    "repetition 1.1": dict(temperature=0.8, repetition_penalty=1.1),
    "presence+frequency": dict(temperature=0.8, presence_penalty=0.5, frequency_penalty=0.5),
}
PROMPT, OUTPUT = 1000, 200  # tokens each sequence holds (the penalties read them)
SPREADS = {"peaked": 6.0, "flat": 1.0}


def _load(path: str):
    spec = importlib.util.spec_from_file_location("old_sampler", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["old_sampler"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", required=True, help="an older core/engine/sampler.py (git show REV:core/engine/sampler.py)")
    ap.add_argument("--rows", default="1,16")
    ap.add_argument("--min-time", type=float, default=0.5, help="seconds per measurement (best of the calls)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not os.path.isfile(args.old):
        sys.exit(f"--old: no such file: {args.old}")
    from paged.core.engine import sampler as new
    from paged.core.engine.request import Request
    from paged.core.engine.sampling_params import SamplingParams
    old = _load(args.old)
    rows_list = [int(r) for r in args.rows.split(",")]
    figures = []
    print(f"{'vocab':>7} {'rows':>4} {'spread':>6}  {'setting':<20} {'old ms':>8} {'new ms':>8} {'old/new':>7}")
    for vocab in VOCABS:
        for rows in rows_list:
            for spread_name, spread in SPREADS.items():
                logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(vocab + rows)) * spread
                for name, kw in SETTINGS.items():
                    params = SamplingParams(**kw, seed=7)
                    seqs = [Request(f"r{i}", None, list(range(100 + i, 100 + i + PROMPT)), params).seqs[0]
                            for i in range(rows)]
                    for s in seqs:
                        s.token_ids.extend(range(3000, 3000 + OUTPUT))
                    samplers = {"old": old.Sampler([0], seed=1), "new": new.Sampler([0], seed=1)}
                    ms = {k: 1e3 * best_time(lambda s=s: s(logits, seqs), args.min_time) for k, s in samplers.items()}
                    ratio = ms["old"] / ms["new"]
                    print(f"{vocab:>7} {rows:>4} {spread_name:>6}  {name:<20} {ms['old']:8.2f} {ms['new']:8.2f} "
                          f"{ratio:6.1f}x", flush=True)
                    figures.append({"vocab": vocab, "rows": rows, "spread": spread_name, "setting": name,
                                    "old_ms": round(ms["old"], 3), "new_ms": round(ms["new"], 3),
                                    "old_over_new": round(ratio, 2)})
    emit_json({"benchmark": "sampler_cost", "old": args.old, "threads": torch.get_num_threads(),
               "figures": figures}, args.json)


if __name__ == "__main__":
    main()
