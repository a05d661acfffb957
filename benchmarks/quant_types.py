"""GGUF quant types at 1B scale, paged beside llama.cpp on the same files.

    # a random-weight Llama of TinyLlama-1.1B's shape (hidden 2048, 22 layers, 32/4 heads,
    # FFN 5632, tied embeddings, the default model's tokenizer), F16, then quantized
    python benchmarks/quant_types.py make --out /tmp/q1b --llama-quantize PATH [--types Q4_0,Q4_K_M,...]
    # or Qwen2.5-0.5B's shape (hidden 896: K-quant presets fall back to Q5_0 / Q8_0 on most rows)
    python benchmarks/quant_types.py make --shape qwen0.5b --out /tmp/q05 --llama-quantize PATH

    # per file: prefill and batch-1 decode tok/s, weight GB/s, RSS after load
    python benchmarks/quant_types.py run /tmp/q1b/*.gguf [--llama-bench PATH] [--json PATH]
        [--serve --llama-server PATH]   # and 16 streams: `paged serve` beside `llama-server -np 16 -cb`

`make` writes the F16 file with gguf-py's GGUFWriter and quantizes it with
llama.cpp's `llama-quantize` (../shared/PEERS.md builds it), whose presets
choose each tensor's type as users' files have them (Q4_K_M: Q4_K with Q6_K
for some V / down matrices and the tied embedding). Without llama-quantize
only Q4_0, Q4_1 and Q8_0 can be made (gguf-py's own quantizers).

`run` measures, per file, in one process one file after another: prefill
of a --prompt-len token prompt (best of --rounds), batch-1 decode of
--decode-tokens tokens, the bytes of weights a decode token reads (every
packed matrix once, as the kernels hold them) and so the GB/s the decode
reaches beside the machine's measured copy bandwidth, and the process RSS
after load minus the KV cache. With --llama-bench it runs `llama-bench -t
THREADS -p PROMPT -n DECODE` on the same file right after and prints the
ratios. Random weights say nothing about accuracy (tests/test_accuracy_gate.py
and benchmarks/accuracy_gate.py do).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
from timing import emit_json, positive_int  # noqa: E402

#: the CPUs this process may use, read before any engine pins its threads (the main thread is one of
#: them, and a child process inherits the forking thread's CPU set): the servers and the client get these
START_CPUS = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None


def _all_cpus() -> None:
    """preexec_fn of the serving processes: the whole machine, not the measured engine's pinned CPU."""
    if START_CPUS:
        os.sched_setaffinity(0, START_CPUS)


#: `make --shape`: TinyLlama-1.1B's (every row a multiple of 256), and Qwen2.5-0.5B's (hidden 896, which
#: llama.cpp's K-quant presets write as Q5_0 / Q5_1 / Q8_0: the fallbacks of rows not a multiple of 256)
SHAPES = {"tinyllama": dict(hidden=2048, layers=22, heads=32, kv_heads=4, ffn=5632, context=2048),
          "qwen0.5b": dict(hidden=896, layers=24, heads=14, kv_heads=2, ffn=4864, context=2048)}
SHAPE = SHAPES["tinyllama"]
TYPES = ("Q4_0", "Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0")


def write_f16_model(path: Path, seed: int = 0) -> None:
    """The random-weight model as F16 GGUF, the default model's tokenizer."""
    import gguf

    from paged.core.models.files import default_model_path
    from paged.core.models.loaders.gguf_reader import read_gguf

    meta, _ = read_gguf(Path(default_model_path(quiet=True)))
    vocab = len(meta["tokenizer.ggml.tokens"])
    h, ffn, heads, kvh = SHAPE["hidden"], SHAPE["ffn"], SHAPE["heads"], SHAPE["kv_heads"]
    hd = h // heads
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(SHAPE["context"])
    w.add_embedding_length(h)
    w.add_block_count(SHAPE["layers"])
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kvh)
    w.add_rope_dimension_count(hd)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    for key, value in meta.items():
        if key.startswith("tokenizer."):
            w.add_key_value(key, value, _value_type(value))
    rng = np.random.default_rng(seed)

    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float16)

    w.add_tensor("token_embd.weight", mat(vocab, h))
    w.add_tensor("output_norm.weight", np.ones(h, dtype=np.float32))
    for i in range(SHAPE["layers"]):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(h, dtype=np.float32))
        w.add_tensor(p + "ffn_norm.weight", np.ones(h, dtype=np.float32))
        for name, rows, cols in (("attn_q", h, h), ("attn_k", kvh * hd, h), ("attn_v", kvh * hd, h),
                                 ("attn_output", h, h), ("ffn_gate", ffn, h), ("ffn_up", ffn, h),
                                 ("ffn_down", h, ffn)):
            w.add_tensor(p + name + ".weight", mat(rows, cols))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=True)
    w.close()


def _value_type(value):
    import gguf

    if isinstance(value, list):
        return gguf.GGUFValueType.ARRAY
    if isinstance(value, str):
        return gguf.GGUFValueType.STRING
    if isinstance(value, bool):
        return gguf.GGUFValueType.BOOL
    if isinstance(value, int):
        return gguf.GGUFValueType.UINT32 if value >= 0 else gguf.GGUFValueType.INT32
    return gguf.GGUFValueType.FLOAT32


def quantize_files(args, stem: str, write_f16, quantize_flags=lambda t: []) -> int:
    """`make`: the F16 file (written once by ``write_f16``) and each of --types
    quantized by --llama-quantize, named ``<stem>-<TYPE>.gguf`` in --out;
    ``quantize_flags(type)`` adds llama-quantize options."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    f16 = out / f"{stem}-F16.gguf"
    if not f16.exists():
        print(f"writing {f16}", flush=True)
        write_f16(f16)
    for t in args.types.split(","):
        target = out / f"{stem}-{t}.gguf"
        if target.exists():
            continue
        if not args.llama_quantize:
            print(f"{t}: needs --llama-quantize (llama.cpp's presets); skipped", file=sys.stderr)
            continue
        subprocess.run([args.llama_quantize, *quantize_flags(t), str(f16), str(target), t, str(args.threads)],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        print(f"{target.name}: {target.stat().st_size / 2**20:.0f} MiB", flush=True)
    return 0


def make(args) -> int:
    global SHAPE
    SHAPE = SHAPES[args.shape]
    return quantize_files(args, f"{args.shape}-shape", write_f16_model)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def copy_bandwidth() -> float:
    """GB/s of a large float32 copy (read + write counted once: what a memcpy moves)."""
    src = torch.ones(64 << 20)  # 256 MiB
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return src.numel() * 4 / best / 1e9


def weight_bytes(model) -> int | None:
    """Bytes of the matrices a decode token reads (each packed weight or its panel once);
    None for a mixture of experts, whose token reads only its routed
    experts (benchmarks/moe.py measures those models)."""
    if any(layer.gate_up is None for layer in model.layers):
        return None
    seen, total = set(), 0
    for mod in [model.lm_head] + [w for layer in model.layers for w in (layer.qkv, layer.o_proj, layer.gate_up,
                                                                         layer.down)]:
        if id(mod) in seen:
            continue
        seen.add(id(mod))
        if isinstance(mod, torch.Tensor):
            total += mod.numel() * mod.element_size()
        else:  # a fused matrix of row parts (CpuPackedLinear.parts) holds its bytes in its parts
            total += sum(read_bytes(part) for part in (getattr(mod, "parts", None) or [mod]))
    return total


def read_bytes(w) -> int:
    """What the kernels stream of one packed matrix: its persistent panel where
    it has one (read instead of the packed arrays), else its packed arrays."""
    panels = w.weight_panels() if hasattr(w, "weight_panels") else None
    if panels is not None:
        return panels.numel()
    return sum(t.numel() * t.element_size() for t in (w.qs, w.d, w.m) if t is not None)


def measure_paged(path: str, args) -> dict:
    from paged.core.engine.config import EngineConfig
    from paged.core.engine.engine import Engine
    from paged.core.engine.sampling_params import SamplingParams

    before = rss_bytes()
    engine = Engine(EngineConfig(model=path, device="cpu", max_model_len=1024, kv_cache_memory="128MiB",
                                 max_num_seqs=4, max_num_batched_tokens=args.prompt_len, itl_target_ms=None,
                                 cpu_threads_bind=f"0-{args.threads - 1}"))  # llama-bench's -t, same CPUs
    committed = engine.worker.kv_cache_committed_bytes()  # None: allocated whole at start
    kv = engine.worker.bytes_per_block * engine.kv_cache_manager.num_blocks if committed is None else committed
    rss = rss_bytes() - before - kv
    model = engine.runner.model
    prompt = [100 + (i * 7) % 1000 for i in range(args.prompt_len)]
    prefill = []
    for r in range(args.rounds):
        engine.add_request(f"p{r}", [t + r for t in prompt], SamplingParams(max_tokens=1))
        t0 = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        prefill.append(time.perf_counter() - t0)
    decode = []
    for r in range(args.rounds):
        engine.add_request(f"d{r}", [5 + r, 6, 7, 8], SamplingParams(max_tokens=args.decode_tokens + 1,
                                                                     ignore_eos=True, temperature=0.0))
        engine.step()  # the prompt and the first token
        t0 = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        decode.append((time.perf_counter() - t0) / args.decode_tokens)
    wbytes = weight_bytes(model)
    step = min(decode)
    out = {"prefill_tok_s": args.prompt_len / min(prefill), "decode_tok_s": 1 / step,
           "weight_bytes": wbytes, "decode_gb_s": wbytes / step / 1e9 if wbytes else None, "rss_minus_kv_bytes": rss,
           "file_bytes": os.path.getsize(path), "weights": engine.weight_format}
    engine.close()
    return out


def measure_llama(path: str, args) -> dict | None:
    if not args.llama_bench:
        return None
    cmd = [args.llama_bench, "-m", path, "-t", str(args.threads), "-p", str(args.prompt_len), "-n",
           str(args.decode_tokens), "-o", "json", "-r", str(args.rounds)]
    # on every CPU (_all_cpus): forked from this process's main thread, which the measured engine pins to
    # one CPU, llama-bench had inherited that one CPU and ran its -t threads on it (1B Q5_K_M on Zen 4:
    # prompt 115.9 and decode 20.4 tok/s against 204 and 35.1 on two CPUs)
    rows = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True, preexec_fn=_all_cpus).stdout)
    got = {}
    for row in rows:
        key = "prefill_tok_s" if row.get("n_prompt") else "decode_tok_s"
        got[key] = float(row["avg_ts"])
    return got


def _wait_ready(url: str, proc, what: str, limit_s: float = 600.0) -> None:
    import urllib.request
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise RuntimeError(f"{what} not ready after {limit_s:.0f} s")


def serve_streams(path: str, args) -> dict:
    """Output tok/s at --streams concurrent streams: paged serve, then
    llama-server (-np STREAMS -cb) when given, each alone on the machine."""
    from serving_peers import bench_argv

    bench = argparse.Namespace(input_len=args.serve_input_len, output_len=args.serve_output_len, seed=100)
    port = 8790
    servers = [("paged", [sys.executable, "-m", "paged.core.entrypoints.cli", "serve", "--model", path,
                          "--host", "127.0.0.1", "--port", str(port), "--max-num-seqs", str(args.streams)])]
    if args.llama_server:
        ctx = args.streams * (args.serve_input_len + args.serve_output_len + 64)
        servers.append(("llamacpp", [args.llama_server, "-m", path, "--host", "127.0.0.1", "--port", str(port),
                                     "-t", str(args.threads), "-np", str(args.streams), "-cb", "-c", str(ctx)]))
    got = {}
    for name, cmd in servers:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=_all_cpus)
        try:
            url = f"http://127.0.0.1:{port}"
            _wait_ready(url, proc, name)
            # server and client in processes of their own on every CPU (_all_cpus): forked from this
            # process's main thread, which the engine measured before pinned to one CPU, they inherited
            # that one CPU (paged serve then ran one thread: 13.0 against 22.8 output tok/s at 16
            # streams on the 1B Q4_0 file, and llama-server shared the same core)
            client = subprocess.run([sys.executable, "-m", "paged.core.entrypoints.cli", "bench", "serve",
                                     *bench_argv(url, name, args.streams, bench)],
                                    capture_output=True, text=True, timeout=3600, preexec_fn=_all_cpus)
            reports = [line for line in client.stdout.splitlines() if line.startswith("{")]
            if client.returncode or not reports:
                raise RuntimeError(f"bench serve against {name} failed: {client.stderr.strip()[-500:]}")
            got[name] = {"output_tok_s": json.loads(reports[-1])["levels"][0]["output_throughput"]}
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    return got


def in_fresh_process(fn, *args):
    """fn(*args) in a spawned process: an engine leaves its thread binding,
    OpenMP pool and freed heap in the process, so a second file measured
    after it ran at about half speed (benchmarks/moe.py) and its RSS delta
    started from the first one's heap (0.1-0.2x the file for 1B s16 files)."""
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(fn, args)


def run(args) -> int:
    bw = copy_bandwidth()
    report = {"copy_gb_s": bw, "threads": args.threads, "prompt_len": args.prompt_len,
              "decode_tokens": args.decode_tokens, "files": {}}
    print(f"copy bandwidth {bw:.1f} GB/s; {args.threads} threads; prompt {args.prompt_len}, decode "
          f"{args.decode_tokens} tokens, best of {args.rounds}")
    print(f"{'file':<34}{'MiB':>6}{'prefill':>9}{'lcpp':>8}{'ratio':>7}{'decode':>8}{'lcpp':>7}{'ratio':>7}"
          f"{'GB/s':>6}{'RSS-KV/file':>12}")
    for path in args.files:
        p = in_fresh_process(measure_paged, path, args)
        lc = measure_llama(path, args)
        report["files"][os.path.basename(path)] = {"paged": p, "llama.cpp": lc}
        ratio = lambda k: f"{p[k] / lc[k]:.2f}x" if lc and lc.get(k) else "-"  # noqa: E731
        fmt = lambda k: f"{lc[k]:.1f}" if lc and lc.get(k) else "-"  # noqa: E731
        print(f"{os.path.basename(path):<34}{p['file_bytes'] / 2**20:>6.0f}{p['prefill_tok_s']:>9.1f}"
              f"{fmt('prefill_tok_s'):>8}{ratio('prefill_tok_s'):>7}{p['decode_tok_s']:>8.2f}"
              f"{fmt('decode_tok_s'):>7}{ratio('decode_tok_s'):>7}{p['decode_gb_s'] or float('nan'):>6.1f}"
              f"{p['rss_minus_kv_bytes'] / p['file_bytes']:>12.2f}", flush=True)
        if args.serve:
            streams = serve_streams(path, args)
            report["files"][os.path.basename(path)]["serving"] = streams
            pg, lcs = streams["paged"]["output_tok_s"], streams.get("llamacpp", {}).get("output_tok_s")
            print(f"  {args.streams} streams: paged {pg:.1f} output tok/s"
                  + (f", llama-server {lcs:.1f} ({pg / lcs:.2f}x)" if lcs else ""), flush=True)
    emit_json(report, args.json)
    return 0


def parse_arguments(doc: str, types: tuple[str, ...], what: str, shapes: tuple[str, ...] = ()) -> argparse.Namespace:
    """`make` and `run`'s options, shared with benchmarks/moe.py (``shapes``: make's --shape choices)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    mk = sub.add_parser("make", help="write the F16 model and its quantizations")
    mk.add_argument("--out", required=True)
    mk.add_argument("--types", default=",".join(types))
    mk.add_argument("--llama-quantize", default=None, metavar="PATH")
    mk.add_argument("--threads", type=positive_int, default=len(os.sched_getaffinity(0)))
    if shapes:
        mk.add_argument("--shape", choices=shapes, default=shapes[0],
                        help="the model's shape (files are named <shape>-shape-<TYPE>.gguf)")
    rn = sub.add_parser("run", help=f"measure paged (and llama.cpp) on {what}")
    rn.add_argument("files", nargs="+")
    rn.add_argument("--llama-bench", default=None, metavar="PATH")
    rn.add_argument("--threads", type=positive_int, default=len(os.sched_getaffinity(0)))
    rn.add_argument("--prompt-len", type=positive_int, default=128)
    rn.add_argument("--decode-tokens", type=positive_int, default=32)
    rn.add_argument("--rounds", type=positive_int, default=2)
    rn.add_argument("--json", default=None, metavar="PATH")
    rn.add_argument("--serve", action="store_true", help="also serve --streams streams over HTTP (paged serve, "
                    "and llama-server -np STREAMS -cb when --llama-server is given)")
    rn.add_argument("--llama-server", default=None, metavar="PATH")
    rn.add_argument("--streams", type=positive_int, default=16)
    rn.add_argument("--serve-input-len", type=positive_int, default=128)
    rn.add_argument("--serve-output-len", type=positive_int, default=64)
    return ap.parse_args()


def main() -> int:
    args = parse_arguments(__doc__, TYPES, "GGUF files", shapes=tuple(SHAPES))
    return make(args) if args.cmd == "make" else run(args)


if __name__ == "__main__":
    sys.exit(main())
