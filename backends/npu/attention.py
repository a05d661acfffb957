"""Ascend NPU attention backend on CANN's own paged-attention operators.

Written against torch_npu 2.13.0 and the older releases named in
docs/ascend.md; the keywords each operator takes are read from the
installed release at start-up (operators.py):
- cache writes: torch_npu.npu_scatter_pa_kv_cache(..., cache_mode="Norm"
  where the release has cache_mode) on caches laid out [num_blocks,
  block_size, Hkv, D] (ND); an index copy on releases without the operator;
- decode and prefill / chunked prefill: torch_npu.npu_fused_infer_attention_score
  with block_table, actual_seq_lengths (query) and actual_seq_lengths_kv,
  BSH layout, the cache viewed as [num_blocks, block_size, Hkv*D]; causal
  prefill uses sparse_mode=3 (right-down causal, so the query rows are the
  LAST positions of each sequence), sliding windows sparse_mode=4 (band)
  with the same 2048 x 2048 mask; a step whose every query is one token
  (Q_S = 1) goes through the decode call, the operator's incremental branch
  (metadata.py), whose window mask is [B, KV_S].
Every host-side list and mask is derived once per step (build_metadata),
from the model runner's host arrays: a runner step makes no device->host
copy, and the per-layer path none either (tests/test_npu_sim.py checks both
on the simulated NPU). The operators' documented limits are checked there
too, with one-line errors.
Block copies and reads are plain torch indexing, which torch_npu runs on
the device. torch_npu is imported only when an operator runs.
"""

from __future__ import annotations

import functools

import torch

from paged.core.argcheck import fail
from paged.backends.base import AttentionMetadata
from paged.backends.npu import layout
from paged.backends.npu import metadata as step
from paged.backends.npu import operators
from paged.backends.reference.attention import ReferenceBackend
from paged.backends.reference import validation as v

__all__ = ["NpuBackend"]


def _torch_npu():
    try:
        import torch_npu  # noqa: F401  (registers torch.npu and the operators)
    except ImportError as e:  # not installed, or CANN libraries missing
        raise RuntimeError(f"the npu backend needs torch_npu with CANN: {e}") from e
    return torch_npu


class NpuBackend(ReferenceBackend):
    """Argument checks and the layout-agnostic block copies (copy_blocks,
    swap_blocks: plain indexing on dim 0) are inherited from the reference
    backend; the cache layout and every kernel are the NPU's own."""

    name = "npu"
    #: each layer attends with its own window (core/models/layer_attention.py): the step's masks per
    #: window come from NpuMetadata.for_window
    per_layer_windows = True

    def __init__(self, num_heads, num_kv_heads, head_size, block_size, dtype, device="npu",
                 scale=None, sliding_window=None, kv_cache_dtype=None):
        layout.check_shape(num_heads, num_kv_heads, head_size, block_size, dtype)
        if kv_cache_dtype not in (None, dtype):  # the operators read the cache in the query's dtype
            fail("kv_cache_dtype (npu)", f"the model dtype {dtype}", kv_cache_dtype)
        super().__init__(num_heads, num_kv_heads, head_size, block_size, dtype, device, scale, sliding_window)

    @functools.cached_property
    def operators(self) -> operators.OperatorPlan:
        """The installed torch_npu's keywords (read once, at the first use:
        the worker's start-up line reads it before any step)."""
        return operators.plan(_torch_npu())

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        return layout.kv_cache_shape(num_blocks, self.block_size, self.num_kv_heads, self.head_size)

    def _flat_cache(self, cache: torch.Tensor) -> torch.Tensor:
        return cache.view(cache.shape[0], self.block_size, self.num_kv_heads * self.head_size)

    def allocate_kv_cache(self, num_layers: int, num_blocks: int):
        # Remembered so build_metadata can check the step's block ids once.
        self.num_blocks = num_blocks
        return super().allocate_kv_cache(num_layers, num_blocks)

    # -- cache writes / reads ---------------------------------------------
    def reshape_and_cache(self, key, value, key_cache, value_cache, slot_mapping) -> None:
        v.check_caches(self, key_cache, value_cache)
        v.check_heads(self, "key", key, self.num_kv_heads)
        v.check_heads(self, "value", value, self.num_kv_heads, rows=key.shape[0])
        v.check_index("slot_mapping", slot_mapping, 1, self.device, length=key.shape[0])
        v.check_slots("slot_mapping", slot_mapping, key_cache.shape[0] * self.block_size)
        keep = slot_mapping >= 0
        if not bool(keep.all()):  # the operator takes no padding slots
            key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
        self._scatter(key, value, key_cache, value_cache, slot_mapping.contiguous())

    def _scatter(self, key, value, key_cache, value_cache, slots) -> None:
        if not key.shape[0]:
            return
        plan = self.operators
        if plan.scatter:
            _torch_npu().npu_scatter_pa_kv_cache(key.contiguous(), value.contiguous(), key_cache, value_cache,
                                                 slots, **plan.scatter_kwargs)
        else:  # a release without the operator: the same rows written by an index copy
            rows = key_cache.shape[0] * self.block_size
            key_cache.view(rows, self.num_kv_heads, self.head_size).index_copy_(0, slots, key)
            value_cache.view(rows, self.num_kv_heads, self.head_size).index_copy_(0, slots, value)

    def read_kv(self, key_cache, value_cache, slot_mapping):
        v.check_caches(self, key_cache, value_cache)
        v.check_index("slot_mapping", slot_mapping, 1, self.device)
        v.check_slots("slot_mapping", slot_mapping, key_cache.shape[0] * self.block_size)
        keep = (slot_mapping >= 0)[:, None, None]
        slots = slot_mapping.clamp(min=0)
        blocks, offsets = slots // self.block_size, slots % self.block_size
        zero = torch.zeros((), dtype=key_cache.dtype, device=key_cache.device)
        return (torch.where(keep, key_cache[blocks, offsets], zero).contiguous(),
                torch.where(keep, value_cache[blocks, offsets], zero).contiguous())

    # -- attention ----------------------------------------------------------
    def _fused_attention(self, query_bsh, key_cache, value_cache, block_tables, kv_lens, scale, **extra):
        out, _ = _torch_npu().npu_fused_infer_attention_score(
            query_bsh, self._flat_cache(key_cache), self._flat_cache(value_cache),
            block_table=block_tables, actual_seq_lengths_kv=kv_lens,
            num_heads=self.num_heads, num_key_value_heads=self.num_kv_heads,
            input_layout="BSH", block_size=self.block_size, **{self.operators.scale_keyword: float(scale)}, **extra)
        return out

    def _decode(self, out, query, key_cache, value_cache, block_tables, lens: list[int], scale, mask) -> None:
        """Q_S = 1: the operator's incremental branch (no sparse_mode; a mask is [B, KV_S])."""
        s, h, d = query.shape
        extra = {} if mask is None else {"atten_mask": mask}
        o = self._fused_attention(query.reshape(s, 1, h * d), key_cache, value_cache, block_tables,
                                  lens, scale, **extra)
        out.copy_(o.reshape(s, h, d))

    def _prefill(self, out, query, key_cache, value_cache, block_tables, meta, scale, window) -> None:
        """Q_S > 1: queries right-padded to BSH by the step's gather indices."""
        padded = layout.pad_queries(query, meta.pad_index, len(meta.prefill_q_lens))
        _, extra = meta.for_window(window)
        o = self._fused_attention(padded, key_cache, value_cache, block_tables, meta.prefill_kv_lens, scale,
                                  actual_seq_lengths=meta.prefill_q_lens, **extra)
        out.copy_(layout.unpad_output(o, meta.unpad_index, self.num_heads))

    def _attend(self, out, query, key_cache, value_cache, meta, block_tables, scale) -> None:
        """A contract op's one-call step: every row through the decode call
        when decode-shaped (Q_S = 1), else the prefill call."""
        if meta.num_decodes:
            self._decode(out, query, key_cache, value_cache, block_tables, meta.decode_kv_lens, scale,
                         meta.decode_mask)
        else:
            self._prefill(out, query, key_cache, value_cache, block_tables, meta, scale, meta.window)

    # -- the contract ops: a one-call step (host lists derived here, not per layer) --
    def _one_call_meta(self, query_start_loc, seq_lens, block_tables, num_decodes, window, pool_blocks):
        common = AttentionMetadata(
            slot_mapping=torch.empty(0, dtype=torch.int64, device=seq_lens.device), query_start_loc=query_start_loc,
            seq_lens=seq_lens, block_tables=block_tables, num_decodes=num_decodes, max_query_len=0, max_seq_len=0)
        return step.build_step(self, common, None, pool_blocks, window)  # (the max lengths: unused by the NPU)

    def paged_attention(self, out, query, key_cache, value_cache, block_tables, seq_lens,
                        scale: float, sliding_window: int = 0) -> None:
        self._check_decode(out, query, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window)
        if not query.shape[0]:
            return
        qsl = torch.arange(query.shape[0] + 1, dtype=torch.int32, device=seq_lens.device)
        meta = self._one_call_meta(qsl, seq_lens, block_tables, query.shape[0], sliding_window, key_cache.shape[0])
        self._attend(out, query, key_cache, value_cache, meta, block_tables, scale)

    def prefill_attention(self, out, query, key_cache, value_cache, query_start_loc, seq_lens,
                          block_tables, scale: float, sliding_window: int = 0) -> None:
        self._check_attention(out, query, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window)
        v.check_index("query_start_loc", query_start_loc, 1, self.device)
        v.check_query_start_loc(query_start_loc, query.shape[0], seq_lens)
        if not seq_lens.shape[0]:
            return
        meta = self._one_call_meta(query_start_loc, seq_lens, block_tables, 0, sliding_window, key_cache.shape[0])
        self._attend(out, query, key_cache, value_cache, meta, block_tables, scale)

    # -- once per step, then every layer: no host round-trip per layer ---------
    num_blocks: int | None = None  # known once allocate_kv_cache ran

    def build_metadata(self, common: AttentionMetadata) -> step.NpuMetadata:
        # block ids and the pool's limits once the cache exists (the worker allocates it first)
        return step.build_step(self, common, self.num_blocks, self.num_blocks)

    def forward(self, query, key, value, kv_cache, meta):
        if not isinstance(meta, step.NpuMetadata):  # a caller outside the model runner (tests)
            n = kv_cache[0].shape[0]  # this cache's size, whatever allocated it
            meta = step.build_step(self, meta, n, n)
        return super().forward(query, key, value, kv_cache, meta)

    def _forward_write(self, key, value, kv_cache, meta) -> None:
        v.check_caches(self, *kv_cache)
        if meta.write_rows is not None:
            key, value = key[meta.write_rows], value[meta.write_rows]
        self._scatter(key, value, kv_cache[0], kv_cache[1], meta.write_slots)

    def _forward_decode(self, out, query, kv_cache, meta, block_tables, seq_lens) -> None:
        mask, _ = meta.for_window(self.sliding_window)
        self._decode(out, query, kv_cache[0], kv_cache[1], block_tables, meta.decode_kv_lens, self.scale, mask)

    def _forward_prefill(self, out, query, kv_cache, meta) -> None:
        _, _, tables = meta.prefill_part
        self._prefill(out, query, kv_cache[0], kv_cache[1], tables, meta, self.scale, self.sliding_window)
