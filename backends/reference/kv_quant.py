"""The int8 KV cache rows in plain torch: the oracle of the kernels' own
quantization (csrc_cpu/attention/kernel_common.h, quantize_row_i8).

A row is one token of one kv head: head_size int8 values, then the row's
float32 scale as 4 bytes (backends/base.py, ``kv_row_width``). Symmetric,
per (token, kv head): scale = max|x| / 127, q = round-half-even(x / scale)
clamped to [-127, 127]; a zero row gets scale 0. A row depends on nothing but
its own values, so a block's bytes are the same however its tokens were
chunked into steps (a prefix-cache hit sees what a miss would have written).
Both sides compute in float32 with the same operations, so the cache bytes
agree bitwise.
"""

from __future__ import annotations

import torch

from paged.backends.base import KV_INT8_SCALE_BYTES


def quantize_int8(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] (any floating dtype) -> int8 rows [..., D + 4]."""
    x = x.float()
    scale = x.abs().amax(dim=-1, keepdim=True) / 127
    q = torch.where(scale > 0, torch.round(x / torch.where(scale > 0, scale, 1)), 0).clamp(-127, 127)
    return torch.cat([q.to(torch.int8), scale.contiguous().view(torch.int8)], dim=-1)


def dequantize_int8(rows: torch.Tensor) -> torch.Tensor:
    """int8 rows [..., D + 4] -> float32 [..., D] (q * scale)."""
    d = rows.shape[-1] - KV_INT8_SCALE_BYTES
    scale = rows[..., d:].contiguous().view(torch.float32)
    return rows[..., :d].float() * scale


def to_cache(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """Token rows [..., D] as the cache stores them."""
    return quantize_int8(x) if cache_dtype == torch.int8 else x.to(cache_dtype)


def from_cache(rows: torch.Tensor) -> torch.Tensor:
    """Cache rows as float32 [..., D] (dequantized when int8)."""
    return dequantize_int8(rows) if rows.dtype == torch.int8 else rows.float()
