"""NpuBackend's per-step metadata, built once per step (``build_step``).

The CANN operators take sequence lengths as host lists and masks as device
tensors; the cache write takes no padding slots. Deriving those per layer
would cost a device->host copy (a sync) in every layer, and a fresh 2048x2048
mask per layer; here they are derived once, with the block-id checks, and
every layer reuses them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from paged.backends.base import AttentionMetadata
from paged.backends.npu import layout
from paged.backends.reference import validation as v


@dataclass
class NpuMetadata(AttentionMetadata):
    write_rows: torch.Tensor | None  # rows of key/value to cache (None: all; the operator takes no padding)
    write_slots: torch.Tensor  # their slots, contiguous
    decode_kv_lens: list[int]
    decode_mask: torch.Tensor | None  # [num_decodes, kv_len] with a sliding window, else None
    prefill_q_lens: list[int]
    prefill_kv_lens: list[int]
    prefill_extra: dict = field(default_factory=dict)  # atten_mask + sparse_mode for the prefill call


def decode_extra(lens: list[int], kv_len: int, window: int, device) -> torch.Tensor | None:
    return layout.decode_window_mask(lens, kv_len, window, device) if window else None


def prefill_extra(q_lens: list[int], kv_lens: list[int], kv_len: int, window: int, device) -> dict:
    if window:  # sparse_mode 0 with an explicit mask
        return {"atten_mask": layout.window_mask(q_lens, kv_lens, kv_len, window, device), "sparse_mode": 0}
    return {"atten_mask": layout.causal_mask(device), "sparse_mode": 3}  # right-down causal


def build_step(be, common: AttentionMetadata, num_blocks: int | None) -> NpuMetadata:
    """One host copy of the step's index tensors; checks them as the contract
    ops would (block ids only once the cache exists), then derives the lists
    and masks every layer passes to the operators."""
    if num_blocks is not None:
        v.check_slots("slot_mapping", common.slot_mapping, num_blocks * be.block_size)
        v.check_block_tables(be, common.block_tables, common.seq_lens, num_blocks)
    nd, kv_len = common.num_decodes, common.block_tables.shape[1] * be.block_size
    kv_lens, starts = common.seq_lens.tolist(), common.query_start_loc.tolist()
    keep = common.slot_mapping >= 0
    rows = None if bool(keep.all()) else keep.nonzero().flatten()
    slots = common.slot_mapping if rows is None else common.slot_mapping[rows]
    q_lens = [b - a for a, b in zip(starts[nd:-1], starts[nd + 1:])]
    pre_kv = kv_lens[nd:]
    if q_lens:
        v.check_query_start_loc(common.query_start_loc[nd:] - starts[nd], starts[-1] - starts[nd],
                                common.seq_lens[nd:])
    window, dev = be.sliding_window, common.seq_lens.device
    return NpuMetadata(
        **common.common_fields(), write_rows=rows, write_slots=slots.contiguous(),
        decode_kv_lens=kv_lens[:nd], decode_mask=decode_extra(kv_lens[:nd], kv_len, window, dev) if nd else None,
        prefill_q_lens=q_lens, prefill_kv_lens=pre_kv,
        prefill_extra=prefill_extra(q_lens, pre_kv, kv_len, window, dev) if q_lens else {})
