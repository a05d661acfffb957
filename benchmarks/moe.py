"""A mixture-of-experts model at ~1B total parameters, paged beside llama.cpp
on the same GGUF file.

    # a random-weight Qwen3-MoE (hidden 1024, 12 layers, 16/4 heads of 64,
    # 64 experts of width 384, top 8: ~1.0B total, ~0.2B active per token;
    # the default model's tokenizer), F16, then quantized by llama.cpp
    python benchmarks/moe.py make --out /tmp/moe1b --llama-quantize PATH [--types Q4_0,Q8_0]

    # per file: prefill and batch-1 decode tok/s beside llama-bench, 16
    # streams' decode tok/s, and the expert weight bytes each step reads;
    # --serve: 16 streams over HTTP, paged serve beside llama-server -np 16 -cb
    python benchmarks/moe.py run /tmp/moe1b/*.gguf [--llama-bench PATH] [--json PATH]
        [--serve --llama-server PATH]

paged runs the experts as packed matrices grouped per step
(core/models/moe.py; on the CPU one extension call per layer,
csrc_cpu/model/moe_experts.h): each expert's matrices are called once per
step on the rows that chose it, so a step reads the bytes of the distinct experts
its rows chose (batch 1: top-k experts per layer; 16 streams: at most
min(experts, 16 k)), counted here from the model's own expert runs.
llama-bench has no concurrent streams (the in-process 16-stream figure is
paged's alone; --serve measures both servers). Random weights route near-uniformly, which is the worst case for
bytes per step at 16 streams; they say nothing about accuracy
(tests/test_moe.py checks the families against HF).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from quant_types import (_value_type, copy_bandwidth, in_fresh_process, measure_llama, parse_arguments,  # noqa: E402
                         quantize_files, serve_streams)
from timing import emit_json  # noqa: E402

SHAPE = dict(hidden=1024, layers=12, heads=16, kv_heads=4, head_dim=64, experts=64, top_k=8, expert_ffn=384,
             context=2048)
TYPES = ("Q4_0", "Q8_0")


def parameter_counts(vocab: int) -> dict[str, int]:
    s = SHAPE
    h, d = s["hidden"], s["head_dim"]
    attn = h * d * (2 * s["heads"] + 2 * s["kv_heads"])
    expert = 3 * h * s["expert_ffn"]
    per_layer_fixed = attn + s["experts"] * h  # attention and the router
    total = s["layers"] * (per_layer_fixed + s["experts"] * expert) + vocab * h
    active = s["layers"] * (per_layer_fixed + s["top_k"] * expert) + vocab * h
    return {"total": total, "active": active}


def write_f16_model(path: Path, seed: int = 0) -> None:
    """The random-weight qwen3moe model as F16 GGUF (router float32), the
    default model's tokenizer, tied embeddings."""
    import gguf

    from paged.core.models.files import default_model_path
    from paged.core.models.loaders.gguf_reader import read_gguf

    meta, _ = read_gguf(Path(default_model_path(quiet=True)))
    vocab = len(meta["tokenizer.ggml.tokens"])
    s = SHAPE
    h, d, e, f = s["hidden"], s["head_dim"], s["experts"], s["expert_ffn"]
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_context_length(s["context"])
    w.add_embedding_length(h)
    w.add_block_count(s["layers"])
    w.add_feed_forward_length(f)
    w.add_expert_feed_forward_length(f)
    w.add_expert_count(e)
    w.add_expert_used_count(s["top_k"])
    w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv_heads"])
    w.add_key_length(d)
    w.add_value_length(d)
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    for key, value in meta.items():
        if key.startswith("tokenizer."):
            w.add_key_value(key, value, _value_type(value))
    rng = np.random.default_rng(seed)

    def mat(*shape: int, scale: float = 0.02) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * scale).astype(np.float16)

    ones = lambda n: np.ones(n, dtype=np.float32)  # noqa: E731
    w.add_tensor("token_embd.weight", mat(vocab, h))
    w.add_tensor("output_norm.weight", ones(h))
    for i in range(s["layers"]):
        p = f"blk.{i}."
        for name, n in (("attn_norm", h), ("ffn_norm", h), ("attn_q_norm", d), ("attn_k_norm", d)):
            w.add_tensor(p + name + ".weight", ones(n))
        for name, rows in (("attn_q", s["heads"] * d), ("attn_k", s["kv_heads"] * d), ("attn_v", s["kv_heads"] * d)):
            w.add_tensor(p + name + ".weight", mat(rows, h))
        w.add_tensor(p + "attn_output.weight", mat(h, s["heads"] * d))
        w.add_tensor(p + "ffn_gate_inp.weight", mat(e, h, scale=0.5).astype(np.float32))
        w.add_tensor(p + "ffn_gate_exps.weight", mat(e, f, h))
        w.add_tensor(p + "ffn_up_exps.weight", mat(e, f, h))
        w.add_tensor(p + "ffn_down_exps.weight", mat(e, h, f))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=True)
    w.close()


def make(args) -> int:
    # a plain type (Q4_0, Q8_0) quantizes the tied embedding / LM head to it too, as the earlier
    # figures did; a preset (Q4_K_M: its own mix, a Q6_K head) keeps llama.cpp's choices, the files
    # users download (llama-quantize takes only ggml types for these flags)
    def flags(t: str) -> list[str]:
        if "_K_" in t.upper():
            return []
        return ["--token-embedding-type", t.lower(), "--output-tensor-type", t.lower()]
    return quantize_files(args, "qwen3moe-1b", write_f16_model, flags)


def _nbytes(w) -> int:
    if hasattr(w, "nbytes") and not callable(w.nbytes):
        return int(w.nbytes)
    return w.numel() * w.element_size()


def expert_bytes(model) -> int:
    """Bytes of one expert's matrices (gate/up and down, as held)."""
    moe = next(layer.moe for layer in model.layers if layer.moe is not None)
    return _nbytes(moe.gate_up[0]) + _nbytes(moe.down[0])


def expert_runs(model) -> int:
    return sum(layer.moe.expert_runs for layer in model.layers if layer.moe is not None)


def _decode(engine, model, streams: int, tokens: int, tag: str) -> dict:
    """``streams`` requests prefilled, then ``tokens`` decode steps of all of
    them timed -> tok/s over every stream and expert runs per step."""
    from paged.core.engine.sampling_params import SamplingParams

    for i in range(streams):
        engine.add_request(f"{tag}{i}", [5 + i, 6, 7, 8 + i], SamplingParams(max_tokens=tokens + 1, ignore_eos=True,
                                                                            temperature=0.0))
    started: set[str] = set()
    while len(started) < streams:  # every prompt prefilled, its first token out
        started.update(o.request_id for o in engine.step() if o.outputs and o.outputs[0].token_ids)
    runs0, steps, t0 = expert_runs(model), 0, time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    elapsed = time.perf_counter() - t0
    return {"tok_s": streams * tokens / elapsed, "expert_runs_per_step": (expert_runs(model) - runs0) / steps}


def measure_paged(path: str, args) -> dict:
    from paged.core.engine.config import EngineConfig
    from paged.core.engine.engine import Engine
    from paged.core.engine.sampling_params import SamplingParams

    cpus = sorted(os.sched_getaffinity(0))[:args.threads]  # as many as llama-bench's -t
    engine = Engine(EngineConfig(model=path, device="cpu", max_model_len=1024, kv_cache_memory="256MiB",
                                 max_num_seqs=args.streams, max_num_batched_tokens=max(args.prompt_len, 256),
                                 itl_target_ms=None, cpu_threads_bind=",".join(map(str, cpus))))
    model = engine.runner.model
    prompt = [100 + (i * 7) % 1000 for i in range(args.prompt_len)]
    prefill = []
    for r in range(args.rounds):
        engine.add_request(f"p{r}", [t + r for t in prompt], SamplingParams(max_tokens=1))
        t0 = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        prefill.append(time.perf_counter() - t0)
    one = max((_decode(engine, model, 1, args.decode_tokens, f"d{r}-") for r in range(args.rounds)),
              key=lambda d: d["tok_s"])
    many = _decode(engine, model, args.streams, args.decode_tokens, "s")
    per_expert = expert_bytes(model)
    out = {"prefill_tok_s": args.prompt_len / min(prefill), "decode_tok_s": one["tok_s"],
           f"decode_{args.streams}_streams_tok_s": many["tok_s"],
           "expert_bytes": per_expert,
           "expert_bytes_per_step_batch1": one["expert_runs_per_step"] * per_expert,
           f"expert_bytes_per_step_{args.streams}_streams": many["expert_runs_per_step"] * per_expert,
           "expert_runs_per_step_batch1": one["expert_runs_per_step"],
           f"expert_runs_per_step_{args.streams}_streams": many["expert_runs_per_step"],
           "file_bytes": os.path.getsize(path), "weights": engine.weight_format,
           "layer_stack": model.layer_stack is not None}
    engine.close()
    return out


def run(args) -> int:
    report = {"cpu": _cpu_name(), "threads": args.threads, "copy_gb_s": copy_bandwidth(),
              "shape": SHAPE, "prompt_len": args.prompt_len, "decode_tokens": args.decode_tokens,
              "streams": args.streams, "files": {}}
    print(f"{report['cpu']}; copy {report['copy_gb_s']:.1f} GB/s; {args.threads} threads; shape {SHAPE}")
    for path in args.files:
        p = in_fresh_process(measure_paged, path, args)
        lc = measure_llama(path, args)
        ratios = {k: p[k] / lc[k] for k in ("prefill_tok_s", "decode_tok_s") if lc and lc.get(k)}
        report["files"][os.path.basename(path)] = {"paged": p, "llama.cpp": lc, "ratios": ratios}
        if args.serve:  # paged serve, then llama-server -np STREAMS -cb, each alone
            served = report["files"][os.path.basename(path)]["serving"] = serve_streams(path, args)
            pg, ls = served["paged"]["output_tok_s"], served.get("llamacpp", {}).get("output_tok_s")
            print(f"  serving {args.streams} streams: paged {pg:.1f} output tok/s"
                  + (f", llama-server {ls:.1f} ({pg / ls:.2f}x)" if ls else ""), flush=True)
        lcs = lambda k: f"{lc[k]:.1f}" if lc and lc.get(k) else "-"  # noqa: E731
        print(f"{os.path.basename(path)}: prefill {p['prefill_tok_s']:.1f} tok/s (llama.cpp {lcs('prefill_tok_s')}), "
              f"decode {p['decode_tok_s']:.2f} tok/s (llama.cpp {lcs('decode_tok_s')}), "
              f"{args.streams} streams {p[f'decode_{args.streams}_streams_tok_s']:.1f} tok/s; ratios "
              f"{ {k: round(v, 2) for k, v in ratios.items()} }; expert MiB/step batch 1 "
              f"{p['expert_bytes_per_step_batch1'] / 2**20:.1f}, {args.streams} streams "
              f"{p[f'expert_bytes_per_step_{args.streams}_streams'] / 2**20:.1f}", flush=True)
    emit_json(report, args.json)
    return 0


def _cpu_name() -> str:
    with open("/proc/cpuinfo") as f:
        return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown")


def main() -> int:
    args = parse_arguments(__doc__, TYPES, "MoE GGUF files")
    return make(args) if args.cmd == "make" else run(args)


if __name__ == "__main__":
    sys.exit(main())
