"""One decode step of the default model on the CPU backend, split into matmul,
attention and everything else, with the fused C++ layer ops and with the
torch ops side by side (same run, same weights, same cache).

    python benchmarks/decode_step.py [--batch 1 16] [--context 128] [--dtype float32] [--weights packed|dense]
                                     [--kv-cache-dtype auto|float32|float16|bfloat16]
                                     [--block-size N] [--threads N] [--min-time 2] [--json PATH]

The cache has the CPU platform's block size (128) unless --block-size says
otherwise, so attention reads K/V in the runs the engine's cache has.

Columns (milliseconds per step, best of many runs: the figure least distorted
by other processes on a shared machine):
  ops        stack: all layers in one C++ call (the engine's default; no split),
             fused: the same C++ kernels called layer by layer from Python,
             torch: torch's elementwise ops
  step       model forward + logits, as the engine runs it
  matmul     time inside the step's linear calls (4 per layer + lm_head)
  attention  time inside the attention backend's forward (30 calls)
  rest       step - matmul - attention: embedding, norms, RoPE, SiLU, copies,
             Python dispatch between ops
  elementwise  the layer ops alone, outside the model (norms, RoPE + Q/K/V
             split, SiLU-and-mul of 30 layers)
"""

from __future__ import annotations

import argparse
import os
import json
import platform
import time

import torch
from timing import best_time, positive_int

from paged.backends.base import AttentionMetadata
from paged.backends.cpu.attention import CpuBackend
from paged.backends.cpu.worker import CpuWorker, prepare_model
from paged.core.models.loaders import load_model_files
from paged.core.models.files import default_model_path
from paged.core.models import build_model
from paged.core.models import llama
from paged.core.models.layers import TorchLayerOps, linear
from paged.platforms.cpu import CpuPlatform

def _best_time(fn, min_time: float, max_reps: int = 500) -> float:
    return best_time(fn, min_time, max_reps, warmup=2, min_reps=5)


class DecodeCase:
    """Batch of `batch` sequences, each `context` tokens long with its last
    token new: the inputs of one decode step and of its elementwise ops."""

    def __init__(self, model, backend, batch: int, context: int):
        c = model.config
        block = backend.block_size
        self.model, self.backend, self.batch = model, backend, batch
        blocks_per_seq = (context + block - 1) // block
        self.caches = backend.allocate_kv_cache(c.num_layers, blocks_per_seq * batch)
        for k, v in self.caches:  # a plausible cache: random, not zeros
            k.normal_(), v.normal_()
        pos = context - 1
        self.ids = torch.randint(0, c.vocab_size, (batch,), generator=torch.Generator().manual_seed(0))
        self.positions = torch.full((batch,), pos, dtype=torch.int64)
        self.meta = AttentionMetadata(
            slot_mapping=torch.tensor([i * blocks_per_seq * block + pos for i in range(batch)]),
            query_start_loc=torch.arange(batch + 1, dtype=torch.int32),
            seq_lens=torch.full((batch,), context, dtype=torch.int32),
            block_tables=torch.arange(blocks_per_seq * batch, dtype=torch.int32).view(batch, -1),
            num_decodes=batch, max_query_len=1, max_seq_len=context)
        dt = model.dtype
        self.x = torch.randn(batch, c.hidden_size).to(dt)
        self.qkv = torch.randn(batch, (c.num_heads + 2 * c.num_kv_heads) * c.head_dim).to(dt)
        self.gate_up = torch.randn(batch, 2 * c.intermediate_size).to(dt)

    @torch.inference_mode()
    def step(self):
        hidden = self.model(self.ids, self.positions, self.caches, self.meta)
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def elementwise(self):
        m, ops = self.model, self.model.ops
        residual, hidden = self.x.clone(), self.x.clone()
        rope_in = ops.rope_inputs(m.rope, self.positions)
        for layer in m.layers:
            x, residual = ops.add_rms_norm(hidden, residual, layer.input_norm, layer.eps)
            ops.rope_split_qkv(self.qkv, m.rope, rope_in, layer.num_heads, layer.num_kv_heads, layer.head_dim)
            x, residual = ops.add_rms_norm(hidden, residual, layer.post_norm, layer.eps)
            ops.silu_and_mul(self.gate_up)


class SplitTimer:
    """Times the step's matmuls and attention calls from inside the real step
    (the model's ``linear`` and the backend's ``forward`` wrapped with timers),
    so the split comes from the same run as the total."""

    def __init__(self, backend):
        self.backend, self.matmul, self.attention = backend, 0.0, 0.0
        self._forward = backend.forward

    def __enter__(self):
        def timed_linear(*args, **kwargs):
            t0 = time.perf_counter()
            out = linear(*args, **kwargs)
            self.matmul += time.perf_counter() - t0
            return out

        def timed_forward(*args, **kwargs):
            t0 = time.perf_counter()
            out = self._forward(*args, **kwargs)
            self.attention += time.perf_counter() - t0
            return out

        llama.linear, self.backend.forward = timed_linear, timed_forward
        return self

    def __exit__(self, *exc):
        llama.linear = linear
        del self.backend.forward  # back to the class method


def measure(case: DecodeCase, min_time: float, max_reps: int = 300) -> dict:
    """Figures of the fastest step (best of many: least disturbed by other
    processes), and the isolated elementwise ops."""
    runs = []
    case.step(), case.step()
    start = time.perf_counter()
    while len(runs) < 5 or (time.perf_counter() - start < min_time and len(runs) < max_reps):
        with SplitTimer(case.backend) as timer:
            t0 = time.perf_counter()
            case.step()
            total = time.perf_counter() - t0
        runs.append((total, timer.matmul, timer.attention))
    total, matmul, attention = min(runs)
    ms = 1e3
    return dict(step_ms=total * ms, matmul_ms=matmul * ms, attention_ms=attention * ms,
                rest_ms=(total - matmul - attention) * ms,
                elementwise_ms=_best_time(case.elementwise, min_time / 2) * ms)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--context", type=int, default=128, help="tokens per sequence, the new one included")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: as is)")
    ap.add_argument("--weights", choices=("packed", "dense"), default="packed",
                    help="GGUF Q4/Q8 matrices kept packed, as the engine runs them (default), or dequantized")
    ap.add_argument("--kv-cache-dtype", choices=("auto", "float32", "float16", "bfloat16"), default="auto",
                    help="what the cache stores (default: auto, the CPU platform's choice, as the engine runs)")
    ap.add_argument("--block-size", type=positive_int, default=CpuPlatform.default_block_size,
                    help="KV cache block size (default: the CPU platform's, %(default)s)")
    ap.add_argument("--min-time", type=float, default=2.0, help="seconds of repeats per figure")
    ap.add_argument("--json", default=None, help="also write the figures here")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)

    worker = CpuWorker(CpuPlatform())
    mode = worker.linear_activations() if args.weights == "packed" else None
    packed_linear = None if mode is None else worker.packed_linear(mode)
    loaded = load_model_files(str(default_model_path()), dtype, keep_packed=packed_linear is not None)
    c = loaded.config
    kv_dtype = (worker.auto_kv_cache_dtype(dtype, mode)
                if args.kv_cache_dtype == "auto" else getattr(torch, args.kv_cache_dtype))
    backend = CpuBackend(c.num_heads, c.num_kv_heads, c.head_dim, args.block_size, dtype, "cpu",
                         sliding_window=c.sliding_window, kv_cache_dtype=kv_dtype)
    model = build_model(c, loaded.weights, dtype, "cpu", backend, packed_linear)
    prepare_model(model)  # the CPU worker's choice: fused layer ops, the stack where eligible
    # (layer ops, layer stack on): "stack" is the engine's default path (all
    # layers in one C++ call, so it has no matmul/attention split), "fused" the
    # same kernels called layer by layer from Python, "torch" torch's own ops.
    fused = model.ops
    variants = {"fused": (fused, "0"), "torch": (TorchLayerOps(), "0")}
    if getattr(model, "layer_stack", None) is not None:
        variants = {"stack": (fused, "1"), **variants}
    if fused.name != "cpu-fused":
        print("note: fused CPU ops unavailable (PAGED_FUSED_OPS=0 or extension not built)")

    results = []
    for batch in args.batch:
        case = DecodeCase(model, backend, batch, args.context)
        for name, (ops, stack) in variants.items():
            model.ops = ops
            os.environ["PAGED_LAYER_STACK"] = stack
            results.append(dict(batch=batch, ops=name, **measure(case, args.min_time)))

    cols = ["step_ms", "matmul_ms", "attention_ms", "rest_ms", "elementwise_ms"]
    print(f"decode step, default model ({c.num_layers} layers, hidden {c.hidden_size}), {args.dtype}, "
          f"{args.weights} weights, {str(kv_dtype).removeprefix('torch.')} cache (block {args.block_size}), "
          f"context {args.context}, {torch.get_num_threads()} threads; ms per step, best of runs")
    print(f"{'batch':>5} {'ops':>6} " + " ".join(f"{k[:-3]:>11}" for k in cols))
    for r in results:
        split = r["ops"] != "stack" or None  # the stack's layers run inside one call: no split
        print(f"{r['batch']:>5} {r['ops']:>6} " + " ".join(
            f"{r[k]:>11.3f}" if split or k in ("step_ms", "elementwise_ms") else f"{'-':>11}" for k in cols))
    for batch in args.batch:
        f, t = (next(r for r in results if r["batch"] == batch and r["ops"] == o) for o in ("fused", "torch"))
        st = next((r for r in results if r["batch"] == batch and r["ops"] == "stack"), None)
        if st:
            print(f"batch {batch}: layer stack step {st['step_ms']:.2f} ms vs {f['step_ms']:.2f} ms layer by layer "
                  f"(x{f['step_ms'] / st['step_ms']:.2f})")
        print(f"batch {batch}: rest {t['rest_ms']:.2f} -> {f['rest_ms']:.2f} ms "
              f"(x{t['rest_ms'] / max(f['rest_ms'], 1e-9):.1f}), elementwise {t['elementwise_ms']:.2f} -> "
              f"{f['elementwise_ms']:.2f} ms (x{t['elementwise_ms'] / f['elementwise_ms']:.1f}), "
              f"step {t['step_ms']:.2f} -> {f['step_ms']:.2f} ms")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(dict(machine=platform.processor() or platform.machine(), dtype=args.dtype,
                           kv_cache_dtype=str(kv_dtype).removeprefix("torch."),
                           context=args.context, block_size=args.block_size, threads=torch.get_num_threads(),
                           results=results), fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
