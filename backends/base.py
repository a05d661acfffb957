"""The attention backend interface: the kernel contract every platform meets.

See docs/kernels.md for the full contract. In short, per layer the KV cache is
a pair of tensors (key_cache, value_cache) whose layout the backend chooses
(``kv_cache_shape``). The ops are:

- reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    key/value [T, Hkv, D]; slot = block * block_size + offset; slot < 0 = padding, skipped.
- paged_attention(out, query, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window)
    decode: query/out [S, H, D], one new token per sequence, already written to the cache.
- prefill_attention(out, query, key_cache, value_cache, query_start_loc, seq_lens, block_tables, scale, sliding_window)
    varlen causal: sequence i owns query rows query_start_loc[i]:query_start_loc[i+1],
    which are its LAST q_i positions (seq_lens[i] - q_i .. seq_lens[i] - 1); keys are
    positions 0 .. seq_lens[i]-1 read from the cache (cached prefix + new tokens).
- copy_blocks(key_caches, value_caches, block_mapping)      block_mapping [N, 2] (src, dst), all layers
- swap_blocks(src_cache, dst_cache, block_mapping)          one tensor to another (device <-> host)
- read_kv(key_cache, value_cache, slot_mapping) -> (key, value) [T, Hkv, D]   (tests / debugging)

KV cache dtype (``kv_cache_dtype``, --kv-cache-dtype): the model dtype by
default; a backend that implements it may store bfloat16 under a float32
model, or int8: each row (one token of one kv head) is head_size int8 values
followed by its float32 scale, 4 bytes viewed as int8 (``kv_row_width``),
quantized by reshape_and_cache per (token, kv head), symmetric, scale =
max|x| / 127, q = round-half-even(x / scale); or float8_e4m3fn, the same
rows with scale = max|x| / 448 and codes e4m3fn(clamp(x / scale, +-448))
(``SCALED_KV_DTYPES``; docs/kernels.md).

Index tensors: slot_mapping int64; block_tables, seq_lens, query_start_loc int32.
sliding_window: 0 or None = unlimited; else key j is visible to query i iff
i - window < j <= i. scale multiplies q.k before softmax.

Per step (vLLM's AttentionBackend.get_builder_cls): the model runner builds the
common AttentionMetadata, then calls ``build_metadata`` once; every layer's
``forward`` receives what it returns. A backend that derives something per
step (CUDA: launch sizes, the split-K workspace; NPU: host-side length lists
and masks) does it there, never per layer.
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass, field, fields
from functools import cached_property
from typing import Optional

import torch

from paged.core.argcheck import fail

#: bytes of the float32 scale that ends each row of an int8 / fp8 KV cache
KV_INT8_SCALE_BYTES = 4
#: KV cache dtypes stored as one-byte codes plus a per-row float32 scale
SCALED_KV_DTYPES = (torch.int8, torch.float8_e4m3fn)


def kv_row_width(head_size: int, kv_cache_dtype: torch.dtype) -> int:
    """Elements of one KV cache row (one token of one kv head): head_size,
    plus the scale's bytes in an int8 or fp8 cache."""
    return head_size + (KV_INT8_SCALE_BYTES if kv_cache_dtype in SCALED_KV_DTYPES else 0)

@dataclass
class AttentionMetadata:
    """Per-step attention inputs, built once per step by the model runner.

    Sequences are ordered decodes first (one query token each), then
    prefills (chunked prefill / prefix-cache hits included).
    """

    slot_mapping: torch.Tensor  # int64 [num_tokens]
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]
    seq_lens: torch.Tensor  # int32 [num_seqs]
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks_per_seq]
    num_decodes: int  # the first num_decodes sequences have exactly one query token
    max_query_len: int
    max_seq_len: int
    # A fact about the step's rows: query rows from here on are prompt rows
    # (their next token is known), the rows before them generate one
    # (decodes and speculative verify rows). What a platform does with it
    # was decided when the model was made (its precision plan: the CPU's
    # backends/cpu/precision.py). None: not marked.
    first_prompt_row: Optional[int] = field(default=None, kw_only=True)

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    def common_fields(self) -> dict:
        """The common fields only, for a backend's metadata subclass to extend
        (cached halves are not copied: the subclass computes its own once)."""
        return {f.name: getattr(self, f.name) for f in fields(AttentionMetadata)}

    # The decode / prefill halves of the batch, computed once per step (not
    # per layer): every layer's forward splits the batch the same way.
    @cached_property
    def decode_part(self) -> tuple[torch.Tensor, torch.Tensor]:
        nd = self.num_decodes
        return self.block_tables[:nd], self.seq_lens[:nd]

    @cached_property
    def prefill_part(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        nd = self.num_decodes
        qsl = self.query_start_loc[nd:]
        return (qsl - nd if nd else qsl), self.seq_lens[nd:], self.block_tables[nd:]


class AttentionBackend(abc.ABC):
    """Paged attention for one model shape on one device."""

    name: str = ""

    def __init__(self, num_heads: int, num_kv_heads: int, head_size: int, block_size: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu",
                 scale: float | None = None, sliding_window: int | None = None,
                 kv_cache_dtype: torch.dtype | None = None):
        if num_heads % num_kv_heads:
            fail("num_heads", f"a multiple of num_kv_heads ({num_kv_heads})", num_heads)
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.block_size = block_size
        self.dtype = dtype
        #: what the KV cache stores (None: the model dtype)
        self.kv_cache_dtype = kv_cache_dtype or dtype
        self.device = torch.device(device)
        self.scale = float(scale) if scale is not None else head_size ** -0.5
        self.sliding_window = int(sliding_window or 0)

    # -- cache allocation --------------------------------------------------
    @abc.abstractmethod
    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        """Shape of one layer's key cache (the value cache has the same)."""

    def allocate_kv_cache(self, num_layers: int, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        shape = self.kv_cache_shape(num_blocks)
        return [
            (torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device),
             torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device))
            for _ in range(num_layers)
        ]

    def bytes_per_block(self, num_layers: int) -> int:
        """Key and value bytes of one block in every layer, from the cache's
        own shape and dtype (an int8 cache's scales included)."""
        elem = torch.empty((), dtype=self.kv_cache_dtype).element_size()
        return 2 * num_layers * math.prod(self.kv_cache_shape(1)) * elem

    # -- the kernel contract ------------------------------------------------
    @abc.abstractmethod
    def reshape_and_cache(self, key, value, key_cache, value_cache, slot_mapping) -> None: ...

    @abc.abstractmethod
    def paged_attention(self, out, query, key_cache, value_cache, block_tables, seq_lens,
                        scale: float, sliding_window: int = 0) -> None: ...

    @abc.abstractmethod
    def prefill_attention(self, out, query, key_cache, value_cache, query_start_loc, seq_lens,
                          block_tables, scale: float, sliding_window: int = 0) -> None: ...

    @abc.abstractmethod
    def copy_blocks(self, key_caches, value_caches, block_mapping) -> None: ...

    @abc.abstractmethod
    def swap_blocks(self, src_cache, dst_cache, block_mapping) -> None: ...

    @abc.abstractmethod
    def read_kv(self, key_cache, value_cache, slot_mapping) -> tuple[torch.Tensor, torch.Tensor]: ...

    # -- per-step metadata -------------------------------------------------
    def build_metadata(self, common: AttentionMetadata) -> AttentionMetadata:
        """Called once per step, after the flat inputs are built; every
        layer's ``forward`` gets the result. The default adds nothing (the
        CPU and reference hot path pays one call per step, nothing per layer)."""
        return common

    # -- one attention layer of a mixed batch --------------------------------
    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        """query [T, H, D], key/value [T, Hkv, D] for this step's tokens.
        Writes the new K/V into the cache (``_forward_write``), then attends:
        decodes through ``_forward_decode``, the rest through
        ``_forward_prefill``. By default these are the contract's ops; a
        backend overrides them to use what its ``build_metadata`` derived."""
        self._forward_write(key, value, kv_cache, meta)
        out = torch.empty_like(query)
        nd, ns = meta.num_decodes, meta.num_seqs
        if nd == ns:  # all decodes: no slicing
            self._forward_decode(out, query, kv_cache, meta, meta.block_tables, meta.seq_lens)
            return out
        if nd:
            self._forward_decode(out[:nd], query[:nd], kv_cache, meta, *meta.decode_part)
        self._forward_prefill(out[nd:] if nd else out, query[nd:] if nd else query, kv_cache, meta)
        return out

    def _forward_write(self, key, value, kv_cache, meta) -> None:
        self.reshape_and_cache(key, value, kv_cache[0], kv_cache[1], meta.slot_mapping)

    def _forward_decode(self, out, query, kv_cache, meta, block_tables, seq_lens) -> None:
        self.paged_attention(out, query, kv_cache[0], kv_cache[1], block_tables, seq_lens,
                             self.scale, self.sliding_window)

    def _forward_prefill(self, out, query, kv_cache, meta) -> None:
        qsl, lens, tables = meta.prefill_part
        self.prefill_attention(out, query, kv_cache[0], kv_cache[1], qsl, lens, tables,
                               self.scale, self.sliding_window)
