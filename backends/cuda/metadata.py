"""CudaBackend's per-step metadata: what every layer's launch needs that
depends on the step only, derived once by ``CudaBackend.build_metadata``.

- ``prefill_max_query_len``: row tiles to launch per prefill sequence (the
  step's longest query; decodes have one row, so the common max is it);
  known on the host, so no device sync and no mutable field on the backend.
- ``decode_splits`` and the split-K workspace (``split_out``,
  ``split_max_sum``): one allocation per step instead of one per layer;
  layers run one after another on one stream, so they can share it.
- the block-id checks (``check_step_ids``): once per step, on host copies of
  the step's index tensors, before any layer launches; the layers then run
  unchecked (the kernels' own guards remain).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from paged.backends.base import AttentionMetadata
from paged.backends.reference import validation as v


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


def check_step_ids(block_size: int, common: AttentionMetadata, num_blocks: int) -> None:
    """The step's block ids against a cache of ``num_blocks`` blocks, as the
    contract ops check them (IndexError / ValueError naming the value): slots,
    block tables of every sequence, and the prefill rows' query_start_loc.
    One host copy of each index tensor per step (works on inference tensors:
    nothing here needs a version counter)."""
    host = {name: getattr(common, name).cpu()
            for name in ("slot_mapping", "block_tables", "seq_lens", "query_start_loc")}
    v.check_slots("slot_mapping", host["slot_mapping"], num_blocks * block_size)
    v.check_block_tables(_BlockSize(block_size), host["block_tables"], host["seq_lens"], num_blocks)
    nd, qsl = common.num_decodes, host["query_start_loc"]
    if nd < common.num_seqs:
        v.check_query_start_loc(qsl[nd:] - qsl[nd], int(qsl[-1] - qsl[nd]), host["seq_lens"][nd:])


@dataclass(frozen=True)
class _BlockSize:
    block_size: int  # what check_block_tables reads of a backend
