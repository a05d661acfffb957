"""GGUF tensor dequantisation to a torch compute dtype.

The simple block formats (Q8_0, Q4_0, Q4_1) are dequantised with vectorised
torch ops (multi-threaded, several times faster than the numpy reference);
the others go through ``gguf.quants.dequantize``.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf import quants

#: quant types this loader accepts: the float types and every type the CPU kernels take
SUPPORTED_TYPES = (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K,
                   Q.Q6_K, Q.IQ4_NL, Q.IQ4_XS)


def _as_tensor(array: np.ndarray) -> torch.Tensor:
    """Zero-copy view of a (read-only, memory-mapped) array; it is only read."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "array is not writable"
        return torch.from_numpy(array)


def _f16(raw: torch.Tensor) -> torch.Tensor:
    """[N, 2] uint8 little-endian halves -> [N, 1] float32."""
    return raw.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[N, 16] packed bytes -> [N, 32] float32 values 0..15 (low nibbles first,
    as ggml stores). Written straight into one float buffer: fewer passes."""
    out = torch.empty((qs.shape[0], 2, 16), dtype=torch.float32)
    out[:, 0] = qs & 0x0F
    out[:, 1] = qs >> 4
    return out.view(-1, 32)


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:  # [N, 34]: f16 d, int8 qs[32]
    d = _f16(blocks[:, :2])
    return blocks[:, 2:].contiguous().view(torch.int8).float().mul_(d)


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:  # [N, 18]: f16 d, qs[16]
    d = _f16(blocks[:, :2])
    return _nibbles(blocks[:, 2:]).sub_(8.0).mul_(d)


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:  # [N, 20]: f16 d, f16 m, qs[16]
    d = _f16(blocks[:, :2])
    m = _f16(blocks[:, 2:4])
    return _nibbles(blocks[:, 4:]).mul_(d).add_(m)


_TORCH_BLOCK_DEQUANT = {Q.Q8_0: _q8_0, Q.Q4_0: _q4_0, Q.Q4_1: _q4_1}
_PLAIN = {Q.F32: torch.float32, Q.F16: torch.float16, Q.BF16: torch.bfloat16}


def dequantize(data: np.ndarray, qtype: Q, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Raw GGUF tensor bytes (uint8) -> a contiguous tensor of ``shape`` in ``dtype``.

    ``shape`` is in torch order (rows first). Raises ValueError for a type
    outside SUPPORTED_TYPES or data of the wrong size.
    """
    if qtype not in SUPPORTED_TYPES:
        raise ValueError(f"unsupported GGUF quantization type {getattr(qtype, 'name', qtype)}")
    raw = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
    numel = int(np.prod(shape))
    block, type_size = GGML_QUANT_SIZES[qtype]
    if numel % block or raw.size != numel // block * type_size:
        raise ValueError(f"{qtype.name} data has {raw.size} bytes, expected "
                         f"{numel // block * type_size} for shape {tuple(shape)}")
    if qtype in _PLAIN:
        # a copy even when the dtype matches: a view would keep the whole
        # file mapping (every page the loader touched) in the process's RSS
        return _as_tensor(raw).view(_PLAIN[qtype]).reshape(shape).to(dtype, copy=True)
    elif qtype in _TORCH_BLOCK_DEQUANT:
        out = _TORCH_BLOCK_DEQUANT[qtype](_as_tensor(raw).view(-1, type_size)).reshape(shape)
    else:
        rows = raw.reshape(-1, shape[-1] // block * type_size)
        out = torch.from_numpy(quants.dequantize(rows, qtype)).reshape(shape)
    return out.to(dtype).contiguous()
