"""Where tensor parallelism parts from one process: every decoder layer's
output (hidden state and residual) of a -tp N model against -tp 1, step by
step, both on the Python layer path.

    .venv/bin/python benchmarks/tp_divergence.py [--tp 2] [--activations mixed] [--steps 8] [--json PATH]

The ranks are threads taking turns (core/engine/distributed/local_group.py) running
the real sharding and TensorParallelOps; rank 0's layer outputs are compared
with the single process's. One prompt is prefilled, then --steps tokens are
decoded greedily from the single process's choices (so both see the same
inputs). Prints, per step, the first layer whose outputs differ and the
largest difference there and at the last layer; exits 1 when any differ.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from timing import emit_json, positive_int  # noqa: E402

BLOCK = 16
PROMPT = "Tensor parallel ranks must compute the same bits as one process, or a user who adds ranks"


def build(config, weights, activations: str, parallel=None):
    from paged.backends.cpu.attention import CpuBackend
    from paged.backends.cpu.quant_linear import CpuPackedLinear
    from paged.backends.cpu.worker import prepare_model
    from paged.core.models import build_model

    backend = CpuBackend(config.num_heads, config.num_kv_heads, config.head_dim, BLOCK, torch.float32, "cpu",
                         kv_cache_dtype=torch.float16 if activations.startswith("mixed") else torch.float32)
    model = build_model(config, weights, torch.float32, "cpu", backend,
                        functools.partial(CpuPackedLinear, activations=activations), parallel)
    prepare_model(model)
    model.layer_stack = None  # the Python layer path: the stack runs no collectives
    caches = backend.allocate_kv_cache(config.num_layers, 64)
    outputs: list = []
    for layer in model.layers:
        layer.register_forward_hook(lambda _m, _i, out: outputs.append(tuple(t.clone() for t in out)))
    return model, caches, outputs


def step_inputs(tokens: list[int], start: int):
    """One sequence, rows start..len(tokens)-1 (all prompt rows when start
    is 0, else one generating row), blocks 0, 1, ..."""
    from paged.backends.base import AttentionMetadata

    n, total = len(tokens) - start, len(tokens)
    blocks = -(-total // BLOCK)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(start, total, dtype=torch.int64),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32), seq_lens=torch.tensor([total], dtype=torch.int32),
        block_tables=torch.arange(blocks, dtype=torch.int32).view(1, blocks), num_decodes=0 if start == 0 else 1,
        max_query_len=n, max_seq_len=total)
    meta.first_prompt_row = 0 if start == 0 else n
    return torch.tensor(tokens[start:]), torch.arange(start, total), meta


def forward(model, caches, outputs, tokens, start):
    outputs.clear()
    ids, pos, meta = step_inputs(tokens, start)
    hidden = model(ids, pos, caches, meta)
    return model.compute_logits(hidden[-1:])[0], list(outputs)


def compare(single: list, rank0: list) -> dict:
    """Per layer, the largest |difference| of (hidden, residual)."""
    diffs = [max((a - b).abs().max().item() for a, b in zip(x, y)) for x, y in zip(single, rank0)]
    first = next((i for i, d in enumerate(diffs) if d > 0), None)
    return {"first_layer": first, "at_first": None if first is None else diffs[first], "last": diffs[-1],
            "per_layer": diffs}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a .gguf file (default: the default model)")
    ap.add_argument("--tp", type=positive_int, default=2)
    ap.add_argument("--activations", default="mixed", help="float32, int8, int8x2, mixed")
    ap.add_argument("--steps", type=positive_int, default=8)
    ap.add_argument("--json", default=None, metavar="PATH")
    args = ap.parse_args()

    from paged.core.engine.distributed.local_group import ThreadRanks
    from paged.core.engine.distributed.parallel_ops import TensorParallelOps
    from paged.core.engine.distributed.sharding import local_config, plan_shards, shard_weights
    from paged.core.models.loaders import load_model_files
    from paged.core.models.files import resolve_model

    loaded = load_model_files(str(resolve_model(args.model, quiet=True)), torch.float32, quiet=True,
                              keep_packed=True)
    config, weights = loaded.config, loaded.weights
    single = build(config, weights, args.activations)
    group = ThreadRanks(args.tp)
    ranks = []
    for shard in plan_shards(config, args.tp):
        ranks.append(build(local_config(config, shard), shard_weights(weights, config, shard), args.activations,
                           TensorParallelOps(group.comm(shard.rank), shard)))

    tokens = loaded.tokenizer.encode(PROMPT)
    report, start = [], 0
    with torch.inference_mode():
        for step in range(args.steps + 1):
            logits, ref = forward(*single, tokens, start)
            results = group.run([lambda _c, r=r: forward(*r, tokens, start) for r in ranks])
            row = compare(ref, results[0][1])
            row.update(step=step, rows=len(tokens) - start, logits=(logits - results[0][0]).abs().max().item())
            report.append(row)
            where = "none" if row["first_layer"] is None else f"layer {row['first_layer']} ({row['at_first']:.3g})"
            print(f"step {step:2d} ({row['rows']:3d} rows): first differing layer {where}; last layer "
                  f"{row['last']:.3g}; logits {row['logits']:.3g}")
            start = len(tokens)
            tokens = tokens + [int(logits.argmax())]
    emit_json({"tp": args.tp, "activations": args.activations, "steps": report}, args.json)
    return 1 if any(r["first_layer"] is not None or r["logits"] > 0 for r in report) else 0


if __name__ == "__main__":
    sys.exit(main())
