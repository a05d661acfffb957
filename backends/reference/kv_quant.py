"""The quantized KV cache rows in plain torch: the oracle of the kernels' own
quantization (csrc_cpu/attention/kernel_common.h, quantize_row_i8 /
quantize_row_fp8).

A row is one token of one kv head: head_size one-byte codes, then the row's
float32 scale as 4 bytes (backends/base.py, ``kv_row_width``). Symmetric,
per (token, kv head), scale = max|x| / qmax; a zero row gets scale 0 and
codes 0.

- int8: qmax = 127, q = round-half-even(x / scale) clamped to [-127, 127];
- float8_e4m3fn (--kv-cache-dtype fp8_e4m3): qmax = 448 (e4m3fn's largest
  value), codes = torch's float8_e4m3fn(clamp(x / scale, -448, 448)), round
  to nearest even (the clamp keeps a division's rounding from passing 448:
  e4m3fn has no infinity).

A row depends on nothing but its own values, so a block's bytes are the same
however its tokens were chunked into steps (a prefix-cache hit sees what a
miss would have written). Both sides compute in float32 with the same
operations, so the cache bytes agree bitwise.
"""

from __future__ import annotations

import torch

from paged.backends.base import KV_INT8_SCALE_BYTES

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def _codes_and_scale(x: torch.Tensor, qmax: float):
    x = x.float()
    scale = x.abs().amax(dim=-1, keepdim=True) / qmax
    return torch.where(scale > 0, x / torch.where(scale > 0, scale, 1), 0), scale


def quantize_int8(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] (any floating dtype) -> int8 rows [..., D + 4]."""
    y, scale = _codes_and_scale(x, 127)
    q = torch.round(y).clamp(-127, 127)
    return torch.cat([q.to(torch.int8), scale.contiguous().view(torch.int8)], dim=-1)


def quantize_fp8(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] (any floating dtype) -> float8_e4m3fn rows [..., D + 4]."""
    y, scale = _codes_and_scale(x, FP8_MAX)
    q = y.clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return torch.cat([q.view(torch.uint8), scale.contiguous().view(torch.uint8)], dim=-1).view(FP8)


def dequantize(rows: torch.Tensor) -> torch.Tensor:
    """int8 or float8_e4m3fn rows [..., D + 4] -> float32 [..., D] (value * scale)."""
    d = rows.shape[-1] - KV_INT8_SCALE_BYTES
    scale = rows[..., d:].contiguous().view(torch.float32)
    return rows[..., :d].float() * scale


def to_cache(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """Token rows [..., D] as the cache stores them."""
    if cache_dtype == torch.int8:
        return quantize_int8(x)
    return quantize_fp8(x) if cache_dtype == FP8 else x.to(cache_dtype)


def from_cache(rows: torch.Tensor) -> torch.Tensor:
    """Cache rows as float32 [..., D] (dequantized when int8 or fp8)."""
    return dequantize(rows) if rows.dtype in (torch.int8, FP8) else rows.float()
