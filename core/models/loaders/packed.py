"""GGUF block-quantized weights kept packed (not dequantized at load).

Matrices of the types the CPU kernels take (quant_layouts.LAYOUT: Q4_0,
Q4_1, Q8_0, Q5_0, Q5_1, Q2_K..Q6_K, IQ4_NL, F16, BF16) stay in their GGUF
blocks until a platform's packed linear unpacks them into its layout
(``fields``), so the kernels read 4.5-16 bits per weight instead of 32; every other consumer
calls ``dequantize``. Values are exactly gguf's dequantization: the packed
form changes bytes moved, not maths.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from paged.core.models.loaders.quant_layouts import (HALF_LAYOUTS, LAYOUT, as_s16, dequantize_layout, unpack,
                                                     widen_scales)

#: GGUF types the packed form (and the CPU kernels) understand -> kernel layout
PACKABLE = LAYOUT
#: values per quantization block of the kernels' layouts (a K-quant's super-block is 256)
QUANT_BLOCK = 32


@dataclass
class PackedBlocks:
    """A [rows, cols] matrix as raw GGUF blocks: ``blocks`` is uint8
    [rows, row bytes], one row of blocks per matrix row."""

    qtype: Q
    blocks: torch.Tensor
    shape: tuple[int, int]

    @property
    def kernel_type(self) -> str:
        """The kernel layout its fields come in (quant_layouts.py)."""
        return LAYOUT[self.qtype]

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
        """(qs, d, m) in ``kernel_type``'s layout (quant_layouts.py)."""
        return unpack(self.qtype, self.blocks, self.shape)[1:]


@dataclass
class PackedFields:
    """A matrix already in a kernel layout: what rows of several GGUF types
    fused into one matrix (QKV, gate/up) become, in the s16 layout that holds
    every type's values."""

    kernel_type: str
    qs: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None

    @property
    def shape(self) -> tuple[int, int]:
        return (self.qs.shape[0], self.qs.shape[1] * (2 if self.kernel_type.startswith("q4") else 1))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qs, self.d, self.m) if t is not None)

    def fields(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        return self.qs, self.d, self.m

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_layout(self.kernel_type, self.qs, self.d, self.m).to(dtype)


@dataclass
class PackedParts:
    """A fused matrix (QKV) whose consecutive row groups stay in kernel
    layouts of their own (Q4_K_M's Q and K rows q4_1, its Q6_K V rows s16):
    a platform that says ``takes_row_parts`` runs each group and joins the
    outputs, instead of holding every row in the s16 layout (1.5 bytes per
    weight with offsets, against Q4_K's 0.75 in q4_1)."""

    parts: list  # PackedBlocks / PackedFields, in row order

    kernel_type = "parts"

    @property
    def shape(self) -> tuple[int, int]:
        return (sum(p.shape[0] for p in self.parts), self.parts[0].shape[1])

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return torch.cat([p.dequantize(dtype) for p in self.parts])


def _as_s16(parts: list) -> PackedFields:
    """Packed blocks of several types as one s16 matrix (every row keeps its values)."""
    s16 = [as_s16(p.kernel_type, *p.fields()) for p in parts]
    mins = None if all(m is None for _, _, m in s16) else torch.cat(
        [m if m is not None else torch.zeros_like(d) for _, d, m in s16])
    return PackedFields("s16", torch.cat([q for q, _, _ in s16]), torch.cat([d for _, d, _ in s16]), mins)


def _cat_one_layout(parts: list) -> "PackedBlocks | PackedFields":
    """Packed blocks whose types share one kernel layout, as one matrix."""
    if len({p.qtype for p in parts}) == 1:
        return parts[0].with_rows(torch.cat([p.blocks for p in parts]))
    if parts[0].kernel_type == "s16":
        return _as_s16(parts)
    fields = [p.fields() for p in parts]  # q4_0 / q4_1 / q8_0 fields of several GGUF types (Q4_K and Q4_1)
    if len({f[1].dtype for f in fields}) > 1:  # compact scales beside float32 ones: all float32
        layout = parts[0].kernel_type
        fields = [(q, widen_scales(d, layout), widen_scales(m, layout)) for q, d, m in fields]
    cat = lambda i: None if fields[0][i] is None else torch.cat([f[i] for f in fields])  # noqa: E731
    return PackedFields(parts[0].kernel_type, cat(0), cat(1), cat(2))


def _part_key(p: PackedBlocks) -> object:
    """What the rows of one row part share: the kernel layout, and for s16 the GGUF type too. s16 rows of
    several types in one matrix take the widest type's code bits for every row and float32 scales (Q3_K_L's
    QKV, Q3_K Q/K rows and a Q5_K V: 10 bits a weight); as parts each keeps its packed form (3.6 and 5.6)."""
    return (p.kernel_type, p.qtype) if p.kernel_type == "s16" else p.kernel_type


def cat_rows(parts: list, row_parts: bool = False) -> "PackedBlocks | PackedFields | PackedParts | torch.Tensor":
    """Concatenate matrices along rows (fused QKV / gate-up): tensors with
    torch.cat, packed blocks of one GGUF type block-row-wise, packed blocks
    of several types in one kernel layout as that layout's fields; of
    several layouts, with ``row_parts`` (the platform runs PackedParts) as
    PackedParts of consecutive same-layout groups (s16 rows also of one
    GGUF type: ``_part_key``), else as s16 fields
    (every row keeps its values); a 16-bit float part among other types
    makes the whole matrix dense float32 (neither layout holds the other's
    values); a mix of packed and dense is the caller's to dequantize first."""
    if all(isinstance(p, PackedBlocks) for p in parts):
        if len({p.qtype for p in parts}) == 1:
            return parts[0].with_rows(torch.cat([p.blocks for p in parts]))
        if any(p.kernel_type in HALF_LAYOUTS for p in parts):
            return torch.cat([p.dequantize(torch.float32) for p in parts])
        groups: list[list[PackedBlocks]] = []
        for p in parts:
            if groups and _part_key(groups[-1][0]) == _part_key(p):
                groups[-1].append(p)
            else:
                groups.append([p])
        if len(groups) == 1:
            return _cat_one_layout(parts)
        return PackedParts([_cat_one_layout(g) for g in groups]) if row_parts else _as_s16(parts)
    if any(isinstance(p, PackedBlocks) for p in parts):
        raise TypeError("cat_rows: mixed packed/dense; dequantize first")
    return torch.cat(parts)
