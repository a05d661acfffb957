"""Offline generation throughput, side by side in one run.

    .venv/bin/python benchmarks/offline_throughput.py --num-prompts 16 --input-len 64 --output-len 64

Systems: paged (bf16 and fp32) and HF transformers generate on the same GGUF
(float32 and bfloat16), each at batch 1 and with all prompts batched; with
--llama-cpp-python PYTHON (the interpreter of a venv holding llama-cpp-python,
see ../shared/PEERS.md) also llama.cpp on the GGUF's own quantized weights
(system "llamacpp-q"; it has no batching, so its "batched" runs are serial).
The prompts are the same random token ids for everyone; EOS is ignored so
every system generates exactly --output-len tokens per prompt.

Figures per system: batch-1 decode tok/s (generation after the first token)
and batched output tok/s (all output tokens / wall time). Only ratios from
the same run mean anything on a shared machine. Prints a table, then JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import torch


def make_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(n)]


# -- paged -----------------------------------------------------------------------
def bench_paged(model_path: str, dtype: str, prompts, output_len: int, threads_bind: str) -> dict:
    from paged.core.engine.engine import Engine
    from paged.core.engine.config import EngineConfig
    from paged.core.entrypoints.llm import LLM
    from paged.core.engine.sampling_params import SamplingParams

    engine = Engine(EngineConfig(model=model_path, device="cpu", dtype=dtype, cpu_threads_bind=threads_bind,
                                 max_model_len=max(len(p) for p in prompts) + output_len + 16,
                                 max_num_seqs=len(prompts), max_num_batched_tokens=2048,
                                 enable_prefix_caching=False, kv_cache_memory="1GiB"))
    llm = LLM.from_engine(engine)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)

    llm.generate(prompts[0], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))  # first-use costs
    t0 = time.perf_counter()
    out = llm.generate(prompts[0], params)[0]
    total = time.perf_counter() - t0
    first = out.metrics.first_token_time - out.metrics.arrival_time
    decode1 = (output_len - 1) / max(total - first, 1e-9)

    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    engine.platform.release_thread()  # unpin this thread: the systems measured next get every CPU
    return {"system": "paged", "dtype": dtype, "batch1_decode_tok_s": decode1, "batch1_ttft_s": first,
            "batched_output_tok_s": n_out / wall, "batched_wall_s": wall, "threads": torch.get_num_threads()}


# -- HF transformers --------------------------------------------------------------
def bench_hf(model_path: str, dtype: str, prompts, output_len: int) -> dict:
    import transformers

    tdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(model_path), gguf_file=os.path.basename(model_path), dtype=tdtype).eval()

    def generate(batch, n_new):
        ids = torch.tensor(batch)
        with torch.inference_mode():
            t0 = time.perf_counter()
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_new, min_new_tokens=n_new,
                           do_sample=False, pad_token_id=0)
            return time.perf_counter() - t0

    generate(prompts[:1], 2)  # warm-up
    t_first = generate(prompts[:1], 1)
    t_all = generate(prompts[:1], output_len)
    decode1 = (output_len - 1) / max(t_all - t_first, 1e-9)
    wall = generate(prompts, output_len)  # equal-length prompts: no padding needed
    return {"system": "hf-transformers", "dtype": dtype, "batch1_decode_tok_s": decode1, "batch1_ttft_s": t_first,
            "batched_output_tok_s": len(prompts) * output_len / wall, "batched_wall_s": wall,
            "threads": torch.get_num_threads()}


# -- llama.cpp (llama-cpp-python, in its own venv) ---------------------------------
_LLAMA_CPP_SCRIPT = r"""
import json, sys, time
from llama_cpp import Llama
cfg = json.loads(sys.stdin.read())
llm = Llama(cfg["model"], n_threads=cfg["threads"], n_ctx=cfg["n_ctx"], verbose=False)
def run(prompt):
    t0 = time.perf_counter(); first = None; n = 0
    for _ in llm.create_completion(prompt, max_tokens=cfg["output_len"], temperature=0.0, repeat_penalty=1.0,
                                   logit_bias={cfg["eos"]: -100.0}, stream=True):
        n += 1
        first = first or time.perf_counter()
    return t0, first, time.perf_counter(), n
run(cfg["prompts"][0][:8])  # warm-up
t0, first, end, n = run(cfg["prompts"][0])
start = time.perf_counter()
total = sum(run(p)[3] for p in cfg["prompts"])
wall = time.perf_counter() - start
print(json.dumps({"batch1_decode_tok_s": (n - 1) / (end - first), "batch1_ttft_s": first - t0,
                  "batched_output_tok_s": total / wall, "batched_wall_s": wall}))
"""


def bench_llama_cpp(python: str, model_path: str, prompts, output_len: int, threads: int, cpus=None) -> dict:
    """llama-cpp-python in a child process on ``cpus`` (a forked child inherits the forking thread's CPU
    set, and paged's engine pins this process's main thread to one CPU)."""
    import subprocess

    cfg = {"model": model_path, "prompts": prompts, "output_len": output_len, "threads": threads,
           "n_ctx": max(len(p) for p in prompts) + output_len + 16, "eos": 2}
    r = subprocess.run([python, "-c", _LLAMA_CPP_SCRIPT], input=json.dumps(cfg), capture_output=True,
                       text=True, timeout=3600, preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)
    if r.returncode != 0:
        raise SystemExit(f"llama-cpp-python run failed: {r.stderr.strip()[-500:]}")
    return {"system": "llama.cpp", "dtype": "gguf", "threads": threads, **json.loads(r.stdout.strip().splitlines()[-1])}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="GGUF file (default: the default SmolLM2)")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--systems", default="paged-bf16,paged-fp32,hf-fp32,hf-bf16",
                    help="comma list of paged-bf16, paged-fp32, hf-fp32, hf-bf16")
    ap.add_argument("--cpu-threads-bind", default="auto")
    ap.add_argument("--llama-cpp-python", default=None, metavar="PYTHON",
                    help="python of a venv with llama-cpp-python: adds llama.cpp (same GGUF, same prompts)")
    ap.add_argument("--json", default=None, help="also write the JSON here")
    args = ap.parse_args(argv)

    from paged.core.models.files import resolve_model

    model_path = str(resolve_model(args.model))
    prompts = make_prompts(args.num_prompts, args.input_len, 49152)
    # before paged's engine pins this thread to one CPU: the peer gets every CPU we have
    start_cpus = os.sched_getaffinity(0)
    num_cpus = len(start_cpus)
    results = []
    for name in args.systems.split(","):
        system, _, short = name.strip().partition("-")
        dtype = {"bf16": "bfloat16", "fp32": "float32"}[short]
        print(f"running {name} ...", file=sys.stderr, flush=True)
        if system == "paged":
            results.append(bench_paged(model_path, dtype, prompts, args.output_len, args.cpu_threads_bind))
        elif system == "hf":
            results.append(bench_hf(model_path, dtype, prompts, args.output_len))
        else:
            raise SystemExit(f"unknown system {name!r}")

    if args.llama_cpp_python:
        print("running llama.cpp ...", file=sys.stderr, flush=True)
        results.append(bench_llama_cpp(args.llama_cpp_python, model_path, prompts, args.output_len,
                                       num_cpus, start_cpus))

    base = next((r for r in results if r["system"] == "hf-transformers" and r["dtype"] == "float32"), None)
    print(f"\n{args.num_prompts} prompts x {args.input_len} in / {args.output_len} out, {os.cpu_count()} CPUs")
    print(f"{'system':18} {'dtype':9} {'b1 decode tok/s':>16} {'batched out tok/s':>18} {'vs HF fp32 b1':>14}")
    for r in results:
        ratio = r["batched_output_tok_s"] / base["batch1_decode_tok_s"] if base else float("nan")
        r["batched_vs_hf_fp32_batch1"] = ratio
        print(f"{r['system']:18} {r['dtype']:9} {r['batch1_decode_tok_s']:16.1f} "
              f"{r['batched_output_tok_s']:18.1f} {ratio:13.1f}x")
    report = {"num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len,
              "results": results}
    print(json.dumps(report, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
