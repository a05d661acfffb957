"""CudaBackend's per-step metadata: what every layer's launch needs that
depends on the step only, derived once by ``CudaBackend.build_metadata``.

- ``prefill_max_query_len``: row tiles to launch per prefill sequence (the
  step's longest query; decodes have one row, so the common max is it);
  known on the host, so no device sync and no mutable field on the backend.
- ``decode_splits`` and the split-K workspace (``split_out``,
  ``split_max_sum``): one allocation per step instead of one per layer;
  layers run one after another on one stream, so they can share it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from paged.backends.base import AttentionMetadata


@dataclass
class CudaMetadata(AttentionMetadata):
    prefill_max_query_len: int
    decode_splits: int
    split_out: torch.Tensor  # float32 [num_decodes, H, splits, D], empty when splits == 1
    split_max_sum: torch.Tensor  # float32 [num_decodes, H, splits, 2], empty when splits == 1


def split_workspace(num_seqs: int, num_heads: int, splits: int, head_size: int, device):
    """The decode kernel's split-K partials; empty tensors when it does not split."""
    ws = (num_seqs, num_heads, splits) if splits > 1 else (0, 0, 0)
    split_out = torch.empty((*ws, head_size if splits > 1 else 0), dtype=torch.float32, device=device)
    split_max_sum = torch.empty((*ws, 2 if splits > 1 else 0), dtype=torch.float32, device=device)
    return split_out, split_max_sum
