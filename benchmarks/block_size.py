"""Engine decode throughput at one context length for several KV block sizes,
alternating in one run (the ratio is the figure; absolute tok/s on a shared
machine is noise).

    .venv/bin/python benchmarks/block_size.py [--block-sizes 16,128] [--num-seqs 16]
        [--input-len 1024] [--output-len 64] [--rounds 2] [--json PATH]

Each round builds a float32 engine per block size, prefills the same random
prompts and times the decode: from the last sequence's first token to the
last token (every sequence is decoding then), so prefill does not dilute it.
"""

from __future__ import annotations

import argparse
import statistics

from offline_throughput import make_prompts
from timing import emit_json


def decode_tok_s(block_size: int, prompts: list[list[int]], output_len: int) -> float:
    from paged.core.entrypoints.llm import LLM
    from paged.core.engine.sampling_params import SamplingParams

    llm = LLM(dtype="float32", block_size=block_size)
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))  # warm up
    outs = llm.generate(prompts, params)
    start = max(o.metrics.first_token_time for o in outs)
    end = max(o.metrics.finished_time for o in outs)
    # tokens generated after `start`: at most output_len - 1 per sequence
    return len(outs) * (output_len - 1) / (end - start)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--block-sizes", default="16,128", help="comma separated")
    ap.add_argument("--num-seqs", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", default=None, metavar="PATH")
    args = ap.parse_args(argv)
    try:
        sizes = [int(s) for s in args.block_sizes.split(",") if s]
    except ValueError:
        ap.error(f"--block-sizes wants integers separated by commas, got {args.block_sizes!r}")
    if not sizes or any(s < 1 for s in sizes) or args.output_len < 2 or args.num_seqs < 1 or args.input_len < 1:
        ap.error("block sizes >= 1, --output-len >= 2, --num-seqs and --input-len >= 1")
    prompts = make_prompts(args.num_seqs, args.input_len, 49152)  # the default model's vocabulary
    runs: dict[int, list[float]] = {s: [] for s in sizes}
    for r in range(args.rounds):
        for s in sizes:
            runs[s].append(decode_tok_s(s, prompts, args.output_len))
            print(f"round {r + 1}: block size {s:4d}: {runs[s][-1]:7.1f} decode tok/s", flush=True)
    base = statistics.median(runs[sizes[0]])
    print(f"\n{args.num_seqs} sequences x {args.input_len} prompt tokens, decode tok/s (median of {args.rounds})")
    for s in sizes:
        med = statistics.median(runs[s])
        print(f"  block size {s:4d}: {med:7.1f}  ({med / base:.2f}x block size {sizes[0]})")
    report = {"num_seqs": args.num_seqs, "input_len": args.input_len, "output_len": args.output_len,
              "decode_tok_s": {str(s): runs[s] for s in sizes}}
    emit_json(report, args.json)
    return report


if __name__ == "__main__":
    main()
