"""A sharded model's meeting points (the interface of
core/models/layers.py's SingleDevice), over a rank group's collectives."""

from __future__ import annotations

import torch

from paged.core.engine.distributed.sharding import Shard
from paged.core.models.layers import embedding_rows, linear


class TensorParallelOps:
    """The output projections (o_proj, down) gather their full input from
    every rank, compute this rank's output rows and gather the rows, so every
    value is computed as one process computes it (core/engine/distributed/
    sharding.py); the embedding is looked up in this rank's vocab slice
    (other ids give zero rows) and all-reduced, so every rank holds the full
    hidden state; the LM head's vocab columns are gathered from every rank
    for sampling. A mixture of experts gathers every expert's activations
    of a step at once ("experts") and their output rows at once, two
    gathers per layer whatever the number of experts."""

    def __init__(self, comm, shard: Shard):
        self.comm, self.shard = comm, shard
        self._input_sizes = {"attention": shard.attn_sizes, "mlp": shard.inter_sizes,
                             "experts": shard.expert_inter_sizes, "shared": shard.shared_inter_sizes}

    def output_projection(self, x: torch.Tensor, weight, part: str, **linear_options) -> torch.Tensor:
        return self.gather_outputs(linear(self.gather_inputs(x, part), weight, **linear_options))

    def gather_inputs(self, x: torch.Tensor, part: str) -> torch.Tensor:
        return self.comm.all_gather_cat(x, self._input_sizes[part])

    def gather_outputs(self, y: torch.Tensor) -> torch.Tensor:
        return self.comm.all_gather_cat(y, self.shard.hidden_sizes)

    def embed(self, input_ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        start, end = self.shard.vocab
        mine = (input_ids >= start) & (input_ids < end)
        rows = embedding_rows((input_ids - start).clamp(0, end - start - 1), table)
        return self.comm.all_reduce(rows * mine.unsqueeze(-1).to(rows.dtype))

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor:
        return self.comm.all_gather_cat(logits, self.shard.vocab_sizes)
