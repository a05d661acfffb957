"""A sharded model's meeting points (the interface of
core/models/layers.py's SingleDevice), over a rank group's collectives."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from paged.core.distributed.sharding import Shard


class TensorParallelOps:
    """One all-reduce after each row-parallel matmul (o_proj, down); the
    embedding looked up in this rank's vocab slice (other ids give zero
    rows) and all-reduced, so every rank holds the full hidden state; the
    LM head's vocab columns gathered from every rank for sampling."""

    def __init__(self, comm, shard: Shard):
        self.comm, self.shard = comm, shard

    def reduce(self, t: torch.Tensor) -> torch.Tensor:
        return self.comm.all_reduce(t)

    def embed(self, input_ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        start, end = self.shard.vocab
        mine = (input_ids >= start) & (input_ids < end)
        rows = F.embedding((input_ids - start).clamp(0, end - start - 1), table)
        return self.comm.all_reduce(rows * mine.unsqueeze(-1).to(rows.dtype))

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor:
        return self.comm.all_gather_cat(logits, self.shard.vocab_sizes)
