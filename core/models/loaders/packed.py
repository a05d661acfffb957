"""GGUF block-quantized weights kept packed (not dequantized at load).

Q4_0, Q4_1 and Q8_0 matrices stay in their GGUF blocks so the CPU
quantized-linear kernels read 4.5-8.5 bits per weight instead of 32; every
other consumer calls ``dequantize``. Values are exactly gguf's dequantization
(fp16 scales widened to fp32): the packed form changes bytes moved, not maths.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

#: GGUF types the packed form (and the CPU kernels) understand -> kernel name
PACKABLE = {Q.Q4_0: "q4_0", Q.Q4_1: "q4_1", Q.Q8_0: "q8_0"}
#: values per quantization block of every packable type
QUANT_BLOCK = 32


@dataclass
class PackedBlocks:
    """A [rows, cols] matrix as raw GGUF blocks: ``blocks`` is uint8
    [rows, cols // 32 * type_size], one row of blocks per matrix row."""

    qtype: Q
    blocks: torch.Tensor
    shape: tuple[int, int]

    @property
    def kernel_type(self) -> str:
        return PACKABLE[self.qtype]

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        from paged.core.models.loaders.dequant import dequantize

        return dequantize(self.blocks.numpy(), self.qtype, self.shape, dtype)

    def with_rows(self, blocks: torch.Tensor) -> "PackedBlocks":
        """The same type over another [rows, row_bytes] block matrix (after a
        row permutation or concatenation)."""
        return PackedBlocks(self.qtype, blocks.contiguous(), (blocks.shape[0], self.shape[1]))

    def fields(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(qs, d, m) in the layout of ``_C_cpu.quant_linear``: qs uint8
        [N, K/2] (q4) or int8 [N, K] (q8), d and m float32 [N, K/32]
        (m only for Q4_1)."""
        n, k = self.shape
        _, type_size = GGML_QUANT_SIZES[self.qtype]
        b = self.blocks.view(n, k // 32, type_size)
        d = b[..., 0:2].contiguous().view(torch.float16).float().view(n, k // 32)
        if self.qtype == Q.Q8_0:
            return b[..., 2:].contiguous().view(torch.int8).view(n, k), d, None
        if self.qtype == Q.Q4_0:
            return b[..., 2:].contiguous().view(n, k // 2), d, None
        m = b[..., 2:4].contiguous().view(torch.float16).float().view(n, k // 32)
        return b[..., 4:].contiguous().view(n, k // 2), d, m


def cat_rows(parts: list) -> "PackedBlocks | torch.Tensor":
    """Concatenate matrices along rows (fused QKV / gate-up): tensors with
    torch.cat, packed blocks of one type block-row-wise; a mix is dequantized
    by the caller first."""
    if all(isinstance(p, PackedBlocks) for p in parts) and len({p.qtype for p in parts}) == 1:
        return parts[0].with_rows(torch.cat([p.blocks for p in parts]))
    if any(isinstance(p, PackedBlocks) for p in parts):
        raise TypeError("cat_rows: mixed packed/dense or packed types; dequantize first")
    return torch.cat(parts)
