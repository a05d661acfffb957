"""NpuBackend's per-step metadata, built once per step (``build_step``).

The CANN operators take sequence lengths as host lists and masks as device
tensors; the cache write takes no padding slots; the prefill call takes the
queries right-padded to [B, max_q, H*D]. Deriving those per layer would cost
device->host copies (syncs) in every layer; here the step's lengths and slots
come to the host in ONE copy, and the lists, masks, write rows and the
gather indices of the padding are derived once for every layer.

Decode-shaped steps: when every non-decode sequence has one query token (a
1-token chunked-prefill remainder, a full prefix-cache hit), the whole step
goes through the decode call. With Q_S = 1 the fused operator takes its
incremental branch, where ``sparse_mode`` is not valid and a mask is
[B, KV_S]: the prefill call's arguments would be wrong there.
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
    pad_index: torch.Tensor | None = None  # [B * max_q]: query row behind each padded BSH row
    unpad_index: torch.Tensor | None = None  # [prefill tokens]: padded output row of each real row


def decode_extra(lens: list[int], kv_len: int, window: int, device) -> torch.Tensor | None:
    return layout.decode_window_mask(lens, kv_len, window, device) if window else None


def prefill_extra(q_lens: list[int], kv_lens: list[int], kv_len: int, window: int, device) -> dict:
    if window:  # sparse_mode 0 with an explicit mask
        return {"atten_mask": layout.window_mask(q_lens, kv_lens, kv_len, window, device), "sparse_mode": 0}
    return {"atten_mask": layout.causal_mask(device), "sparse_mode": 3}  # right-down causal, cached


def _host_lists(common: AttentionMetadata) -> tuple[list[int], list[int], list[int]]:
    """seq_lens, query_start_loc and slot_mapping in one device->host copy."""
    parts = (common.seq_lens, common.query_start_loc, common.slot_mapping)
    flat = torch.cat([p.reshape(-1).to(torch.int64) for p in parts]).tolist()
    a, b = parts[0].numel(), parts[0].numel() + parts[1].numel()
    return flat[:a], flat[a:b], flat[b:]


def build_step(be, common: AttentionMetadata, num_blocks: int | None, window: int | None = None) -> NpuMetadata:
    """Checks the step's index tensors as the contract ops would (block ids
    only once the cache exists), then derives what every layer passes to
    the operators. ``window``: the sliding window (default: the backend's)."""
    if num_blocks is not None:
        v.check_slots("slot_mapping", common.slot_mapping, num_blocks * be.block_size)
        v.check_block_tables(be, common.block_tables, common.seq_lens, num_blocks)
    kv_lens, starts, slots = _host_lists(common)
    q_all = [b - a for a, b in zip(starts[:-1], starts[1:])]
    nd = common.num_decodes
    if max(q_all[nd:], default=1) == 1:  # decode-shaped: every sequence through the decode call
        nd = len(kv_lens)
    else:
        v.check_query_start_loc(common.query_start_loc[nd:] - starts[nd], starts[-1] - starts[nd],
                                common.seq_lens[nd:])
    window = be.sliding_window if window is None else int(window or 0)
    dev, kv_len = common.seq_lens.device, common.block_tables.shape[1] * be.block_size
    q_lens, pre_kv = q_all[nd:], kv_lens[nd:]
    fields = common.common_fields() | {"num_decodes": nd}
    return NpuMetadata(
        **fields, **_write_rows(slots, common.slot_mapping),
        decode_kv_lens=kv_lens[:nd], decode_mask=decode_extra(kv_lens[:nd], kv_len, window, dev) if nd else None,
        prefill_q_lens=q_lens, prefill_kv_lens=pre_kv,
        prefill_extra=prefill_extra(q_lens, pre_kv, kv_len, window, dev) if q_lens else {},
        **(layout.padding_indices(q_lens, dev) if q_lens else {}))


def _write_rows(slots: list[int], slot_mapping: torch.Tensor) -> dict:
    rows = [i for i, s in enumerate(slots) if s >= 0]
    if len(rows) == len(slots):
        return {"write_rows": None, "write_slots": slot_mapping.contiguous()}
    index = torch.tensor(rows, dtype=torch.int64, device=slot_mapping.device)
    return {"write_rows": index, "write_slots": slot_mapping[index].contiguous()}
