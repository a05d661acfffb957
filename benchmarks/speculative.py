"""Speculative decoding (n-gram prompt lookup): output tok/s at 1 stream, on and off.

    .venv/bin/python benchmarks/speculative.py                      # default model, K=4
    .venv/bin/python benchmarks/speculative.py --k 6 --lookup-max 4 --lookup-min 2 --json out.json
    .venv/bin/python benchmarks/speculative.py --linear-activations int8     # another CPU path

Two workloads, greedy, EOS ignored, each request alone (1 stream):
- repetitive: "repeat / lightly edit this code" prompts, where the output
  copies long runs of the prompt (what prompt lookup is for);
- random: prompts of random words (seeded), where lookup rarely finds a
  run to propose and the cost of trying shows.
One engine serves both modes (its scheduler's proposer is the switch), rounds
alternate off / on so drift on a shared machine hits both, and the best round
of each counts. Output tok/s = output tokens / wall time of the requests
(prefill included; prefix caching off, so every round prefills); "cpu-time"
is the same ratio over this process's CPU time, the figure to trust on a
machine other jobs share (wall time there measures the queue for a core). Also
reported: acceptance rate, tokens per decoding step, whether the greedy
tokens were equal to plain decoding (and where not, plain decoding's top-2
logit margin at the first difference), and the median forward time by rows
of single-sequence steps (the price of a verify vs a decode). Prints a
table, then JSON.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

from timing import emit_json

SNIPPETS = [
    '''def merge_sort(xs):
    if len(xs) <= 1:
        return xs
    mid = len(xs) // 2
    left = merge_sort(xs[:mid])
    right = merge_sort(xs[mid:])
    out = []
    while left and right:
        out.append(left.pop(0) if left[0] <= right[0] else right.pop(0))
    return out + left + right
''',
    '''class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        if not self.items:
            raise IndexError("pop from an empty stack")
        return self.items.pop()

    def __len__(self):
        return len(self.items)
''',
    '''def read_config(path):
    values = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            key, _, value = line.partition("=")
            values[key.strip()] = value.strip()
    return values
''',
    '''for (int i = 0; i < n; i++) {
    sum += a[i] * b[i];
    if (sum > limit) {
        printf("overflow at %d\\n", i);
        break;
    }
}
''',
]
EDITS = ["Repeat this code exactly:\n{code}\nHere it is again:\n",
         "Rename the function's variables to longer names:\n{code}\nThe same code with longer names:\n",
         "Add a comment at the top of this code:\n{code}\nThe code with a comment added:\n",
         "Copy the following code:\n{code}\nCopy:\n"]
WORDS = ("river market silver engine garden lantern planet quiet orange thunder pencil window "
         "castle mirror forest rocket velvet harbor meadow crystal ladder violin desert candle "
         "falcon island marble needle ocean puzzle saddle temple tunnel walnut").split()


def workloads(seed: int) -> dict[str, list[str]]:
    rng = random.Random(seed)
    repetitive = [EDITS[i % len(EDITS)].format(code=code) for i, code in enumerate(SNIPPETS)]
    rand = ["Write a short story using these words: " + " ".join(rng.choice(WORDS) for _ in range(12)) + "\n"
            for _ in range(len(SNIPPETS))]
    return {"repetitive": repetitive, "random": rand}


def time_steps(engine) -> dict[int, list[float]]:
    """Wraps the worker's execute: seconds of each forward of one sequence
    and no prefill, by its row count (1: a decode, 1 + drafts: a verify)."""
    times: dict[int, list[float]] = {}
    execute = engine.worker.execute

    def timed(out, tables):
        t0 = time.perf_counter()
        result = execute(out, tables)
        if not out.prefills and len(out.scheduled) == 1:
            times.setdefault(out.num_tokens, []).append(time.perf_counter() - t0)
        return result

    engine.worker.execute = timed
    return times


def run_round(llm, prompts, params, spec: bool):
    sched = llm.engine.scheduler
    proposer, sched.proposer = sched.proposer, (sched.proposer if spec else None)
    before = llm.engine.stats()
    try:
        t0, c0 = time.perf_counter(), time.process_time()
        outs = [llm.generate(p, params)[0] for p in prompts]  # one stream: each request alone
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    finally:
        sched.proposer = proposer
    after = llm.engine.stats()
    delta = {k: after[k] - before[k] for k in ("spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")}
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    return (n / wall, n / cpu), [o.outputs[0] for o in outs], delta


def first_difference_margins(spec_outs, plain_outs) -> list[float]:
    """Per request whose greedy tokens differ: the plain run's top-2 logprob
    (= logit) margin at the first differing token."""
    margins = []
    for s, p in zip(spec_outs, plain_outs):
        k = next((i for i, (a, b) in enumerate(zip(s.token_ids, p.token_ids)) if a != b), None)
        if k is not None:
            top2 = sorted(p.logprobs[k].values(), reverse=True)[:2]
            margins.append(round(top2[0] - top2[1], 4))
    return margins


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the default SmolLM2 GGUF")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--linear-activations", default="auto", help="auto | float32 | int8 (the CPU path)")
    ap.add_argument("--no-quantized-weights", action="store_true", help="dequantize GGUF weights to --dtype")
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--lookup-max", type=int, default=4)
    ap.add_argument("--lookup-min", type=int, default=2)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads-bind", default="auto", help="--cpu-threads-bind (default auto)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="also write the JSON report here")
    args = ap.parse_args()

    from paged.core.engine.engine import Engine
    from paged.core.engine.config import EngineConfig
    from paged.core.entrypoints.llm import LLM
    from paged.core.engine.sampling_params import SamplingParams

    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": args.lookup_max,
            "prompt_lookup_min": args.lookup_min}
    engine = Engine(EngineConfig(model=args.model, device="cpu", dtype=args.dtype, max_model_len=1024,
                                 max_num_seqs=4, kv_cache_memory="256MiB", enable_prefix_caching=False,
                                 cpu_threads_bind=args.threads_bind, speculative_config=spec,
                                 linear_activations=args.linear_activations,
                                 quantized_weights=not args.no_quantized_weights))
    llm = LLM.from_engine(engine)
    # logprobs=2: the margin at a first difference (costs both modes the same log_softmax)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True, logprobs=2)
    llm.generate("warm up", SamplingParams(max_tokens=8, ignore_eos=True))
    step_times = time_steps(engine)

    report = {"model": engine.model_path, "weights": engine.weight_format, "speculative_config": spec,
              "output_len": args.output_len,
              "rounds": args.rounds, "threads_bind": args.threads_bind, "workloads": {}}
    print(f"{'workload':<11} {'off tok/s':>10} {'on tok/s':>10} {'speedup':>8} {'cpu-time':>8} {'accept':>7} "
          f"{'tok/step':>8} {'equal':>6}")
    for name, prompts in workloads(args.seed).items():
        best = {False: 0.0, True: 0.0}
        best_cpu = {False: 0.0, True: 0.0}
        tokens, drafted, accepted, emitted = {}, 0, 0, 0
        for _ in range(args.rounds):
            for on in (False, True):
                (tps, tpc), toks, delta = run_round(llm, prompts, params, on)
                best[on], best_cpu[on] = max(best[on], tps), max(best_cpu[on], tpc)
                tokens[on] = toks
                if on:
                    drafted += delta["spec_decode_num_draft_tokens"]
                    accepted += delta["spec_decode_num_accepted_tokens"]
                    emitted += sum(len(o.token_ids) for o in toks)
        row = {"off_tok_s": round(best[False], 2), "on_tok_s": round(best[True], 2),
               "speedup": round(best[True] / best[False], 3),
               # tokens per CPU-second of this process: the same ratio, less exposed to other load
               "off_tok_per_cpu_s": round(best_cpu[False], 2), "on_tok_per_cpu_s": round(best_cpu[True], 2),
               "cpu_speedup": round(best_cpu[True] / best_cpu[False], 3),
               "acceptance_rate": round(accepted / drafted, 3) if drafted else 0.0,
               # a step emits its accepted drafts + 1 token (the first token, from the prefill, counts as one)
               "tokens_per_step": round(emitted / (emitted - accepted), 3),
               "equal_requests": sum(a.token_ids == b.token_ids for a, b in zip(tokens[True], tokens[False])),
               "first_difference_margins": first_difference_margins(tokens[True], tokens[False]),
               "requests": len(prompts)}
        report["workloads"][name] = row
        print(f"{name:<11} {row['off_tok_s']:>10.1f} {row['on_tok_s']:>10.1f} {row['speedup']:>7.2f}x "
              f"{row['cpu_speedup']:>7.2f}x "
              f"{row['acceptance_rate']:>7.2f} {row['tokens_per_step']:>8.2f} "
              f"{row['equal_requests']:>3}/{row['requests']}")
    # what a forward costs by rows: the price of verifying K drafts vs decoding one token
    report["forward_ms_by_rows"] = {n: round(1000 * statistics.median(t), 2) for n, t in sorted(step_times.items())}
    print("median forward ms by rows (1 = decode):", report["forward_ms_by_rows"])
    emit_json(report, args.json)


if __name__ == "__main__":
    sys.exit(main())
