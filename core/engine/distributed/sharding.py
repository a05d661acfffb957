"""Megatron-style sharding of a Llama-family model over tensor-parallel ranks,
as pure functions of the config and the weights (no process group here).

- Attention heads are split by whole KV groups (a KV head and the query heads
  that read it), evenly or not: 3 KV groups over 2 ranks give 2 + 1. With
  more ranks than KV heads, each KV head is replicated on the ranks that share
  its group and the group's query heads are split among them.
- Column-parallel: the fused QKV rows (the rank's heads) and gate/up rows
  (the rank's slice of the intermediate size).
- Output projections (o_proj, down) by output rows too: a rank holds its
  slice of the hidden size over every input column, gathers the full input
  (every rank's heads / intermediate slice) and computes its rows, then the
  rows are gathered. Each output value is then computed exactly as one
  process computes it (the same inputs, the same reduction over every
  column), so a -tp N model's bits equal -tp 1's on every path, quantized
  activations included. Megatron's split (input columns, then an all-reduce
  of partial sums) adds in another order, and one ulp there is enough to
  flip the next layer's int8 activation codes (benchmarks/tp_divergence.py
  shows it). The price: two all-gathers per projection instead of one
  all-reduce (docs/distributed.md).
- Vocab-parallel: the embedding and LM head rows of the rank's vocab slice
  (the lookup is masked and all-reduced, the logits gathered for sampling).
- The intermediate size is split in units of 32 (a GGUF quantization block)
  where it divides; packed matrices are only ever sliced by rows.
- Mixture of experts: every rank holds every expert, sliced like the dense
  MLP (each expert's gate/up rows of the rank's slice of the expert width,
  its down rows of the rank's hidden slice over every input column; the
  shared expert likewise at its own width); the router is replicated, so
  every rank routes every row alike. Expert parallelism (whole experts per
  rank, rows sent to their experts' ranks) would replace these slices with
  an all-to-all around the experts (docs/distributed.md).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from paged.core.models.config import ModelConfig
from paged.core.models.loaders.packed import QUANT_BLOCK, PackedBlocks
from paged.core.models.spec import MoeSpec

Range = tuple[int, int]


@dataclass(frozen=True)
class Shard:
    """What one rank holds: [start, end) ranges of query heads, KV heads, the
    intermediate size, the hidden size (output rows of o_proj and down) and
    the vocabulary; the ``*_sizes`` are every rank's slice lengths, in rank
    order (the gathers need them): attention outputs (query heads x
    head_dim), intermediate, hidden, vocab."""

    rank: int
    world_size: int
    q_heads: Range
    kv_heads: Range
    inter: Range
    hidden: Range
    vocab: Range
    attn_sizes: tuple[int, ...]
    inter_sizes: tuple[int, ...]
    hidden_sizes: tuple[int, ...]
    vocab_sizes: tuple[int, ...]
    #: a mixture of experts' slices of the expert and shared-expert widths
    #: (empty ranges and sizes for a dense model)
    expert_inter: Range = (0, 0)
    shared_inter: Range = (0, 0)
    expert_inter_sizes: tuple[int, ...] = ()
    shared_inter_sizes: tuple[int, ...] = ()

    @property
    def num_heads(self) -> int:
        return self.q_heads[1] - self.q_heads[0]

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]

    def describe(self) -> str:
        return (f"rank {self.rank}: query heads {self.q_heads[0]}-{self.q_heads[1] - 1}, "
                f"KV heads {self.kv_heads[0]}-{self.kv_heads[1] - 1}, "
                f"intermediate {self.inter[0]}:{self.inter[1]}, hidden {self.hidden[0]}:{self.hidden[1]}, "
                f"vocab {self.vocab[0]}:{self.vocab[1]}")


def split_even(n: int, parts: int) -> list[Range]:
    """[0, n) in ``parts`` contiguous ranges whose sizes differ by at most
    one, the larger ones first (3 over 2 -> [(0, 2), (2, 3)])."""
    if parts < 1:
        raise ValueError(f"parts: expected >= 1, got {parts}")
    base, extra = divmod(n, parts)
    out, start = [], 0
    for i in range(parts):
        end = start + base + (1 if i < extra else 0)
        out.append((start, end))
        start = end
    return out


def split_heads(num_heads: int, num_kv_heads: int, world_size: int) -> list[tuple[Range, Range]]:
    """Per rank, (query head range, KV head range), by whole KV groups; KV
    heads replicated only when ranks outnumber them."""
    if world_size > num_heads:
        raise ValueError(f"tensor_parallel_size: expected at most the model's {num_heads} query heads, "
                         f"got {world_size}")
    group = num_heads // num_kv_heads
    if world_size <= num_kv_heads:
        return [((g0 * group, g1 * group), (g0, g1)) for g0, g1 in split_even(num_kv_heads, world_size)]
    out = []
    for kv, (r0, r1) in enumerate(split_even(world_size, num_kv_heads)):
        for a, b in split_even(group, r1 - r0):  # r1 - r0 <= group since world_size <= num_heads
            out.append(((kv * group + a, kv * group + b), (kv, kv + 1)))
    return out


def split_intermediate(size: int, world_size: int) -> list[Range]:
    """The intermediate size in whole 32-wide units where it divides (whole
    quantization blocks for down's columns), else in single columns."""
    unit = QUANT_BLOCK if size % QUANT_BLOCK == 0 else 1
    if size // unit < world_size:
        raise ValueError(f"tensor_parallel_size: expected at most {size // unit} ranks for an intermediate "
                         f"size of {size}, got {world_size}")
    return [(a * unit, b * unit) for a, b in split_even(size // unit, world_size)]


def plan_shards(config: ModelConfig, world_size: int) -> list[Shard]:
    """Every rank's Shard for ``config`` over ``world_size`` ranks."""
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"tensor_parallel_size: expected a positive integer, got {world_size!r}")
    heads = split_heads(config.num_heads, config.num_kv_heads, world_size)
    inter = split_intermediate(config.intermediate_size, world_size)
    hidden = split_even(config.hidden_size, world_size)
    vocab = split_even(config.vocab_size, world_size)
    lengths = lambda ranges, unit=1: tuple((b - a) * unit for a, b in ranges)  # noqa: E731
    sizes = (lengths([q for q, _ in heads], config.head_dim), lengths(inter), lengths(hidden), lengths(vocab))
    moe = model_moe(config)
    experts = split_intermediate(moe.intermediate_size, world_size) if moe else [(0, 0)] * world_size
    shared = (split_intermediate(moe.shared_intermediate_size, world_size) if moe and moe.shared_intermediate_size
              else [(0, 0)] * world_size)
    return [Shard(r, world_size, heads[r][0], heads[r][1], inter[r], hidden[r], vocab[r], *sizes,
                  experts[r], shared[r], lengths(experts), lengths(shared))
            for r in range(world_size)]


def model_moe(config: ModelConfig) -> MoeSpec | None:
    """The experts' description, one for every expert layer (every family
    paged runs has one), or None for a dense model."""
    specs = {layer.moe for layer in config.spec.layers if layer.moe is not None}
    if len(specs) > 1:
        raise ValueError(f"tensor parallelism: expected one expert shape for every layer, got {len(specs)}")
    return specs.pop() if specs else None


def local_config(config: ModelConfig, shard: Shard) -> ModelConfig:
    """The config one rank's model is built from: its heads, intermediate
    slices (the experts' too) and vocab slice."""
    decoder = config.decoder
    moe = model_moe(config)
    if moe is not None:
        local = dataclasses.replace(moe, intermediate_size=shard.expert_inter[1] - shard.expert_inter[0],
                                    shared_intermediate_size=shard.shared_inter[1] - shard.shared_inter[0])
        decoder = config.spec.with_layers(layer if layer.moe is None else dataclasses.replace(layer, moe=local)
                                          for layer in config.spec.layers)
    return dataclasses.replace(config, num_heads=shard.num_heads, num_kv_heads=shard.num_kv_heads,
                               intermediate_size=shard.inter[1] - shard.inter[0],
                               vocab_size=shard.vocab[1] - shard.vocab[0], decoder=decoder)


def rows(t, start: int, end: int):
    """Rows [start, end) of a dense or packed matrix (or a vector)."""
    if isinstance(t, PackedBlocks):
        return t.with_rows(t.blocks[start:end])
    return t[start:end].contiguous()


def shard_weights(weights: dict, config: ModelConfig, shard: Shard) -> dict:
    """HF-named weights -> the same names holding ``shard``'s slices; tensors
    the rank keeps whole (norms, rope_freqs) are passed through."""
    d = config.head_dim
    q, kv, (i0, i1), (h0, h1), (v0, v1) = shard.q_heads, shard.kv_heads, shard.inter, shard.hidden, shard.vocab
    out = dict(weights)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        if name in weights:
            out[name] = rows(weights[name], v0, v1)
    for i in range(config.num_layers):
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        for part in ("weight", "bias"):
            if a + "q_proj." + part in weights:
                out[a + "q_proj." + part] = rows(weights[a + "q_proj." + part], q[0] * d, q[1] * d)
                for n in ("k_proj.", "v_proj."):
                    out[a + n + part] = rows(weights[a + n + part], kv[0] * d, kv[1] * d)
        out[a + "o_proj.weight"] = rows(weights[a + "o_proj.weight"], h0, h1)
        moe = config.spec.layers[i].moe
        mlps = [(m, (i0, i1))] if moe is None else [(f"{m}experts.{e}.", shard.expert_inter)
                                                    for e in range(moe.num_experts)]
        if moe is not None and moe.shared_intermediate_size:
            mlps.append((m + "shared_expert.", shard.shared_inter))
        for prefix, (a0, a1) in mlps:
            for n in ("gate_proj.weight", "up_proj.weight"):
                if prefix + n in weights:  # an ungated MLP has no gate
                    out[prefix + n] = rows(weights[prefix + n], a0, a1)
            out[prefix + "down_proj.weight"] = rows(weights[prefix + "down_proj.weight"], h0, h1)
    return out
