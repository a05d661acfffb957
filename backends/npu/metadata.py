"""NpuBackend's per-step metadata, built once per step (``build_step``).

The CANN operators take sequence lengths as host lists and masks as device
tensors; the cache write takes no padding slots; the prefill call takes the
queries right-padded to [B, max_q, H*D]. All of it is derived once per step
for every layer, from host data:

- a model-runner step reads lengths, slots and block ids from the runner's
  own host arrays (backends/accelerator/host_index.py): no device->host
  copy; metadata made elsewhere (the contract ops, tests) costs one;
- the host-built index arrays (write rows, padding gathers) go to the device
  in one non-blocking copy from pinned memory (model_runner.to_device); the
  sliding-window decode mask is computed on the device from the device's
  seq_lens; the prefill's masks are the cached 2048 x 2048 one.

Checked here, before any layer runs, with one-line errors: the block ids
(once the cache exists), and the operator's documented limits for each
call (``check_call``): the pool's block count at least the sum of every
sequence's blocks in the call (prefix caching shares blocks in the pool but
not in this sum), the one-token branch's int32 element limit on K and V and
its longest key length, batch <= 65536.

Per-layer windows (a model whose layers have their own sliding window,
core/models/layer_attention.py): the masks are derived at build for the
backend's window, and for another window the first time a layer with it
asks (``NpuMetadata.for_window``), once per step and window: device ops
on the step's device seq_lens and host ints, no host read.

Decode-shaped steps: when every non-decode sequence has one query token (a
1-token chunked-prefill remainder, a full prefix-cache hit), the whole step
goes through the decode call. With Q_S = 1 the fused operator takes its
incremental branch, where ``sparse_mode`` is not valid and a mask is
[B, KV_S]: the prefill call's arguments would be wrong there.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from paged.backends.accelerator.host_index import check_step_ids, host_index
from paged.backends.base import AttentionMetadata
from paged.backends.npu import layout
from paged.backends.reference import validation as v
from paged.core.argcheck import fail
from paged.core.engine.model_runner import to_device


@dataclass
class NpuMetadata(AttentionMetadata):
    write_rows: torch.Tensor | None  # rows of key/value to cache (None: all; the operator takes no padding)
    write_slots: torch.Tensor  # their slots, contiguous
    decode_kv_lens: list[int]
    decode_mask: torch.Tensor | None  # [num_decodes, kv_len] with a sliding window, else None
    prefill_q_lens: list[int]
    prefill_kv_lens: list[int]
    prefill_extra: dict = field(default_factory=dict)  # atten_mask + sparse_mode (+ band) for the prefill call
    pad_index: torch.Tensor | None = None  # [B * max_q]: query row behind each padded BSH row
    unpad_index: torch.Tensor | None = None  # [prefill tokens]: padded output row of each real row
    window: int = 0  # the sliding window decode_mask and prefill_extra are for
    kv_len: int = 0  # key columns of the decode mask (block table width x block size)
    other_windows: dict = field(default_factory=dict, repr=False)  # window -> (decode_mask, prefill_extra)

    def for_window(self, window: int) -> tuple[torch.Tensor | None, dict]:
        """(decode mask, prefill mask arguments) for a layer attending with
        ``window``: the step's own, or derived once per step for another
        window (per-layer windows)."""
        window = int(window or 0)
        if window == self.window:
            return self.decode_mask, self.prefill_extra
        if window not in self.other_windows:
            self.other_windows[window] = window_arguments(self.seq_lens[:self.num_decodes], self.kv_len,
                                                          bool(self.prefill_q_lens), window)
        return self.other_windows[window]


def prefill_extra(window: int, device) -> dict:
    """The prefill call's mask arguments: the cached 2048 x 2048 mask with
    right-down causal (sparse_mode 3) or, with a sliding window, the band
    (sparse_mode 4): never a dense [B, 1, max_q, KV_S] mask."""
    extra = {"atten_mask": layout.causal_mask(device), "sparse_mode": 3}
    return extra | layout.band_arguments(window) if window else extra


def window_arguments(decode_seq_lens: torch.Tensor, kv_len: int, has_prefill: bool,
                     window: int) -> tuple[torch.Tensor | None, dict]:
    """The mask arguments of a step's two calls for one window: the decode
    call's [B, KV_S] window mask (None without a window or decodes), the
    prefill call's compressed-mask arguments ({} without prefills)."""
    dev = decode_seq_lens.device
    mask = layout.decode_window_mask(decode_seq_lens, kv_len, window) if window and decode_seq_lens.shape[0] else None
    return mask, (prefill_extra(window, dev) if has_prefill else {})


def check_call(be, kv_lens: list[int], pool_blocks: int | None, one_token: bool) -> None:
    """One operator call's documented limits (ValueError, one line):
    the pool holds at least the sum of the call's per-sequence blocks; with
    Q_S = 1 the key/value tensor fits int32 and no sequence exceeds the
    branch's key length; at most 65536 sequences. (The pool's checks need
    its size: skipped while no cache exists.)"""
    if len(kv_lens) > layout.MAX_BATCH:
        fail("sequences in one npu attention call", f"<= {layout.MAX_BATCH}", len(kv_lens))
    if one_token and max(kv_lens, default=0) > layout.MAX_DECODE_KV_LEN:
        fail("key length of a one-token npu attention call", f"<= {layout.MAX_DECODE_KV_LEN}", max(kv_lens))
    if pool_blocks is None:
        return
    spanned = sum(-(-n // be.block_size) for n in kv_lens)
    if spanned > pool_blocks:
        fail("num_blocks (npu paged attention: the pool must cover the sum of the call's per-sequence blocks)",
             f"at least the {spanned} blocks the call's {len(kv_lens)} sequences span (prefix-shared blocks "
             "count once per sequence; --no-enable-prefix-caching or a larger cache avoids it)", pool_blocks)
    if one_token:
        elements = pool_blocks * be.block_size * be.num_kv_heads * be.head_size
        if elements > layout.INT32_MAX:
            fail("key/value cache elements per layer (npu one-token branch)",
                 f"<= {layout.INT32_MAX} (int32: at most {layout.max_decode_blocks(be.block_size, be.num_kv_heads, be.head_size)} "
                 "blocks; lower --kv-cache-memory / --num-kv-blocks)", elements)


def build_step(be, common: AttentionMetadata, num_blocks: int | None, pool_blocks: int | None,
               window: int | None = None) -> NpuMetadata:
    """Checks the step's index arrays as the contract ops would (block ids
    only once the cache exists: ``num_blocks``) and the operator limits
    against a cache of ``pool_blocks`` blocks, then derives what every layer
    passes to the operators. ``window``: the sliding window (default: the
    backend's)."""
    host = host_index(common)
    nd_in = common.num_decodes
    if num_blocks is not None:
        check_step_ids(be.block_size, host, nd_in, num_blocks)
    kv_lens = host.seq_lens.tolist()
    starts = host.query_start_loc.tolist()
    q_all = [b - a for a, b in zip(starts[:-1], starts[1:])]
    nd = nd_in
    if max(q_all[nd:], default=1) == 1:  # decode-shaped: every sequence through the decode call
        nd = len(kv_lens)
    elif num_blocks is None:  # (check_step_ids did it otherwise)
        v.check_query_start_loc(host.query_start_loc[nd:] - starts[nd], starts[-1] - starts[nd],
                                host.seq_lens[nd:])
    if nd:
        check_call(be, kv_lens[:nd], pool_blocks, one_token=True)
    if nd < len(kv_lens):
        check_call(be, kv_lens[nd:], pool_blocks, one_token=False)
    window = be.sliding_window if window is None else int(window or 0)
    dev, kv_len = common.seq_lens.device, common.block_tables.shape[1] * be.block_size
    decode_mask, extra = window_arguments(common.seq_lens[:nd], kv_len, bool(q_all[nd:]), window)
    q_lens, pre_kv = q_all[nd:], kv_lens[nd:]
    slots = host.slot_mapping.numpy()
    keep = np.flatnonzero(slots >= 0)
    arrays = {} if len(keep) == len(slots) else {"write_rows": keep.astype(np.int64)}
    if q_lens:
        arrays.update(layout.padding_indices(q_lens))
    index = to_device(arrays, dev) if arrays else {}  # one host->device copy, non-blocking
    write_rows = index.get("write_rows")
    return NpuMetadata(
        **(common.common_fields() | {"num_decodes": nd}),
        write_rows=write_rows,
        write_slots=common.slot_mapping.contiguous() if write_rows is None else common.slot_mapping[write_rows],
        decode_kv_lens=kv_lens[:nd],
        decode_mask=decode_mask, prefill_q_lens=q_lens, prefill_kv_lens=pre_kv, prefill_extra=extra,
        pad_index=index.get("pad_index"), unpad_index=index.get("unpad_index"), window=window, kv_len=kv_len)
