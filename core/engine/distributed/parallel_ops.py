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
    for sampling."""

    def __init__(self, comm, shard: Shard):
        self.comm, self.shard = comm, shard
        self._input_sizes = {"attention": shard.attn_sizes, "mlp": shard.inter_sizes}

    def output_projection(self, x: torch.Tensor, weight, part: str, **linear_options) -> torch.Tensor:
        full = self.comm.all_gather_cat(x, self._input_sizes[part])
        return self.comm.all_gather_cat(linear(full, weight, **linear_options), self.shard.hidden_sizes)

    def embed(self, input_ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        start, end = self.shard.vocab
        mine = (input_ids >= start) & (input_ids < end)
        rows = embedding_rows((input_ids - start).clamp(0, end - start - 1), table)
        return self.comm.all_reduce(rows * mine.unsqueeze(-1).to(rows.dtype))

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor:
        return self.comm.all_gather_cat(logits, self.shard.vocab_sizes)
