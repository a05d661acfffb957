"""A serving-shaped CPU step, side by side per linear-activations mode: D
decoding sequences at a given context plus k prompt rows of a new sequence
(a prefill chunk beside decodes, what the ITL-bounded scheduler builds),
through the default model's forward (the layer stack where eligible) with
the engine's cache dtype. The modes' models share the weights and run in
alternating rounds (best round each), so their ratio holds on a loaded
machine.

    python benchmarks/mixed_step.py [--modes mixed,mixed-bf16] [--decodes 16] [--context 320]
        [--prompt-rows 0 8 16 32 64 128 256] [--block-size N] [--rounds 8] [--json PATH]

`--modes mixed,int8x2` prices mixed's one-term middle layers (int8x2 is
mixed with two terms in every layer; docs/kernels.md, "Mixed activations").

The cache has the CPU platform's block size (128) unless --block-size says
otherwise, so the decodes read K/V in the runs the engine's cache has.

What it shows: how a mode's cost grows with the prompt rows a step carries
(every mode's rows ride along one sweep of the weight panels; mixed-bf16 makes every matrix's bfloat16 tiles from the
panels whatever their number, and its prompt rows attend on the tile unit:
docs/kernels.md, "bfloat16 prompt rows" and "bfloat16 prompt attention").
"""

from __future__ import annotations

import argparse
import functools
import time

import torch
from timing import emit_json, positive_int

from paged.backends.base import AttentionMetadata
from paged.backends.cpu.attention import CpuBackend
from paged.backends.cpu.quant_linear import CpuPackedLinear, resolve_activations
from paged.backends.cpu.worker import CpuWorker, prepare_model
from paged.core.models.loaders import load_model_files
from paged.core.models.files import default_model_path
from paged.core.models import build_model
from paged.platforms.cpu import CpuPlatform

def build(mode: str, loaded, block: int):
    c = loaded.config
    kv_dtype = CpuWorker(CpuPlatform()).auto_kv_cache_dtype(torch.float32, mode)
    backend = CpuBackend(c.num_heads, c.num_kv_heads, c.head_dim, block, torch.float32, "cpu",
                         sliding_window=c.sliding_window, kv_cache_dtype=kv_dtype)
    model = build_model(c, loaded.weights, torch.float32, "cpu", backend,
                        functools.partial(CpuPackedLinear, activations=mode))
    prepare_model(model)
    return model, backend


def step_inputs(c, backend, decodes: int, context: int, k: int):
    """Inputs of one step: `decodes` one-row sequences at `context`, then a
    new sequence's first k prompt rows (random cache contents)."""
    block = backend.block_size
    blocks = (max(context, k) + block - 1) // block
    seqs = decodes + (1 if k else 0)
    caches = backend.allocate_kv_cache(c.num_layers, blocks * seqs)
    for key, value in caches:
        key.normal_(), value.normal_()
    slots = [i * blocks * block + context - 1 for i in range(decodes)] + [decodes * blocks * block + j for j in range(k)]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        query_start_loc=torch.tensor(list(range(decodes + 1)) + ([decodes + k] if k else []), dtype=torch.int32),
        seq_lens=torch.tensor([context] * decodes + ([k] if k else []), dtype=torch.int32),
        block_tables=torch.arange(blocks * seqs, dtype=torch.int32).view(seqs, -1),
        num_decodes=decodes, max_query_len=max(1, k), max_seq_len=max(context, k))
    meta.first_prompt_row = decodes
    ids = torch.randint(0, c.vocab_size, (decodes + k,), generator=torch.Generator().manual_seed(k))
    positions = torch.tensor([context - 1] * decodes + list(range(k)))
    return ids, positions, caches, meta


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", default="mixed,mixed-bf16",
                    help="--linear-activations values, comma separated (those this CPU cannot run are left out)")
    ap.add_argument("--decodes", type=int, default=16)
    ap.add_argument("--context", type=int, default=320)
    ap.add_argument("--prompt-rows", type=int, nargs="+", default=[0, 8, 16, 32, 64, 128, 256])
    ap.add_argument("--block-size", type=positive_int, default=CpuPlatform.default_block_size,
                    help="KV cache block size (default: the CPU platform's, %(default)s)")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    modes = []
    for mode in args.modes.split(","):
        try:
            modes.append(resolve_activations(mode))
        except ValueError as exc:
            print(f"left out: {exc}")
    loaded = load_model_files(str(default_model_path()), torch.float32, keep_packed=True)
    c = loaded.config
    models = {mode: build(mode, loaded, args.block_size) for mode in modes}
    print(f"default model, {args.decodes} decodes at context {args.context} (block {args.block_size}) + k prompt rows; "
          f"ms per step (best of {args.rounds} alternating rounds), {torch.get_num_threads()} threads")
    print(f"{'k':>5} " + " ".join(f"{m:>12}" for m in modes))
    rows = []
    for k in args.prompt_rows:
        inputs = {m: step_inputs(c, models[m][1], args.decodes, args.context, k) for m in modes}
        best = {m: float("inf") for m in modes}
        with torch.inference_mode():
            for _ in range(args.rounds + 1):  # the first round warms up
                for m in modes:
                    ids, positions, caches, meta = inputs[m]
                    t0 = time.perf_counter()
                    models[m][0](ids, positions, caches, meta)
                    best[m] = min(best[m], time.perf_counter() - t0)
        rows.append({"prompt_rows": k, "ms": {m: best[m] * 1e3 for m in modes}})
        print(f"{k:5d} " + " ".join(f"{best[m] * 1e3:12.1f}" for m in modes))
    emit_json({"decodes": args.decodes, "context": args.context, "block_size": args.block_size,
               "threads": torch.get_num_threads(), "rows": rows}, args.json)


if __name__ == "__main__":
    main()
