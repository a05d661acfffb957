"""CudaBackend's per-step metadata: what every layer's launch needs that
depends on the step only, derived once by ``build_step``.

- ``prefill_max_query_len``: row tiles to launch per prefill sequence (the
  step's longest query); known on the host.
- ``decode_splits`` and the split-K workspace (``split_out``,
  ``split_max_sum``): sized by the step's longest DECODE sequence
  (launch.decode_splits), not by the block table's width, and allocated
  once per step instead of once per layer (the layers run one after another
  on one stream and share it).
- per-layer windows (core/models/layer_attention.py): a layer whose window
  is narrower than the backend's launches only the partitions its window
  can need (launch.layer_splits) over the front of the step's workspace
  (``layer_launch``);
- the block-id checks: once per step, on the host arrays the model runner
  attached (backends/accelerator/host_index.py), before any layer launches;
  the layers then run unchecked (the kernels' own guards remain).

No device->host copy for a runner step: lengths and ids are read from the
runner's host arrays. Metadata made outside the runner (tests) costs one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from paged.backends.accelerator.host_index import HostIndex, check_step_ids, host_index
from paged.backends.base import AttentionMetadata
from paged.backends.cuda.launch import decode_splits, layer_splits


@dataclass
class CudaMetadata(AttentionMetadata):
    prefill_max_query_len: int
    decode_splits: int
    split_out: torch.Tensor  # float32 [num_decodes, H, splits, D], empty when splits == 1
    split_max_sum: torch.Tensor  # float32 [num_decodes, H, splits, 2], empty when splits == 1
    window: int = 0  # the sliding window decode_splits was sized for (0: none)


def split_workspace(num_seqs: int, num_heads: int, splits: int, head_size: int, device):
    """The decode kernel's split-K partials; empty tensors when it does not split."""
    ws = (num_seqs, num_heads, splits) if splits > 1 else (0, 0, 0)
    split_out = torch.empty((*ws, head_size if splits > 1 else 0), dtype=torch.float32, device=device)
    split_max_sum = torch.empty((*ws, 2 if splits > 1 else 0), dtype=torch.float32, device=device)
    return split_out, split_max_sum


def layer_launch(meta: CudaMetadata, window: int) -> tuple[int, tuple[torch.Tensor, torch.Tensor]]:
    """(partitions, (split_out, split_max_sum)) for a layer attending with
    ``window`` in this step: ``launch.layer_splits`` partitions over the
    leading [num_decodes, H, splits] partials of the step's workspace
    (contiguous views: no allocation, the same under a CUDA graph)."""
    splits = layer_splits(meta.decode_splits, meta.window, window)
    if splits == meta.decode_splits:
        return splits, (meta.split_out, meta.split_max_sum)
    if splits <= 1:  # (the kernel reads no workspace)
        return 1, (meta.split_out.view(-1)[:0], meta.split_max_sum.view(-1)[:0])
    nd, heads, _, head_size = meta.split_out.shape
    n = nd * heads * splits
    return splits, (meta.split_out.view(-1)[:n * head_size].view(nd, heads, splits, head_size),
                    meta.split_max_sum.view(-1)[:n * 2].view(nd, heads, splits, 2))


def max_decode_len(common: AttentionMetadata, host: HostIndex | None, block_size: int) -> int:
    """The longest decode sequence of the step, from host data: the host
    seq_lens when read, else what the block table's width holds (a bound on
    every valid sequence; the kernel writes NaN, never a truncated softmax,
    for a sequence needing more partitions than launched)."""
    nd = common.num_decodes
    if not nd:
        return 0
    if host is not None:
        return int(host.seq_lens[:nd].max())
    return int(common.block_tables.shape[1]) * block_size


def build_step(common: AttentionMetadata, *, block_size: int, num_heads: int, head_size: int,
               sliding_window: int, device, num_blocks: int | None, check_ids: bool) -> CudaMetadata:
    """The step's metadata; block ids checked once when ``check_ids`` and
    the cache exists (``num_blocks``)."""
    check = check_ids and num_blocks is not None
    host = host_index(common) if check or getattr(common, "host", None) is not None else None
    if check:
        check_step_ids(block_size, host, common.num_decodes, num_blocks)
    splits = decode_splits(max_decode_len(common, host, block_size), sliding_window)
    split_out, split_max_sum = split_workspace(common.num_decodes, num_heads, splits, head_size, device)
    return CudaMetadata(**common.common_fields(), prefill_max_query_len=int(common.max_query_len),
                        decode_splits=splits, split_out=split_out, split_max_sum=split_max_sum,
                        window=int(sliding_window or 0))
