"""Every GGUF type the CPU kernels take, unpacked into their layouts
(core/models/loaders/quant_layouts.py), dequantizes to exactly what the
``gguf`` package's reference dequantizer gives: bit for bit, on random
blocks (every bit pattern of the codes and sub-scales is a valid block; the
fp16 super-scales are random finite values, zeros and subnormals included),
and so does the s16 form of every layout (what a fused matrix of mixed
types runs as)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf import quants

from paged.core.models.loaders.quant_layouts import HALF_LAYOUTS, LAYOUT, as_s16, dequantize_layout, unpack, widen_scales

#: byte offsets of each type's fp16 fields within a block
FP16_FIELDS = {Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q8_0: (0,), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.IQ4_NL: (0,), Q.IQ4_XS: (0,),
               Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,), Q.Q3_K: (108,), Q.Q2_K: (80, 82)}
#: the block types (F16 / BF16 keep their values 16-bit: tests/test_half_linear.py)
BLOCK_TYPES = [q for q in LAYOUT if LAYOUT[q] not in HALF_LAYOUTS]


def random_blocks(qtype: Q, rows: int, cols: int, seed: int) -> np.ndarray:
    """Random valid GGUF data [rows, row bytes] of ``qtype``."""
    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block * size), dtype=np.uint8)
    b = raw.reshape(-1, size)
    for offset in FP16_FIELDS[qtype]:
        scale = (rng.standard_normal(b.shape[0]) * 0.05).astype(np.float16)
        scale[::7] = np.float16(0.0)
        scale[3::11] = np.float16(2.0 ** -20)  # subnormal
        b[:, offset:offset + 2] = scale.view(np.uint8).reshape(-1, 2)
    return raw


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def test_the_table_covers_the_common_mixes():
    assert set(FP16_FIELDS) == set(BLOCK_TYPES)
    for qtype, offsets in FP16_FIELDS.items():
        assert max(offsets) + 2 <= GGML_QUANT_SIZES[qtype][1]


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("shape", [(3, 256), (5, 768), (1, 2048)])
def test_unpacked_values_are_ggufs(qtype, shape):
    rows, cols = shape
    raw = random_blocks(qtype, rows, cols, seed=cols + rows)
    want = quants.dequantize(raw, qtype).reshape(rows, cols)
    layout, qs, d, m = unpack(qtype, torch.from_numpy(raw), shape)
    assert layout == LAYOUT[qtype]
    assert np.array_equal(bits(dequantize_layout(layout, qs, d, m).numpy()), bits(want))
    # the s16 form of the same fields holds the same values
    codes, scale, mins = as_s16(layout, qs, d, m)
    assert codes.dtype == torch.int8 and scale.shape == (rows, cols // 16)
    assert np.array_equal(bits(dequantize_layout("s16", codes, scale, mins).numpy()), bits(want))


#: the types whose scales the loader keeps compact (a byte each, a float per 256 weights)
COMPACT = (Q.Q4_K, Q.Q2_K, Q.Q3_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS)


def test_layout_fields_have_the_kernels_shapes_and_dtypes():
    rows, cols = 4, 512
    for qtype in BLOCK_TYPES:
        layout, qs, d, m = unpack(qtype, torch.from_numpy(random_blocks(qtype, rows, cols, 1)), (rows, cols))
        per = 16 if layout == "s16" else 32
        assert qs.shape == (rows, cols // 2 if layout.startswith("q4") else cols)
        assert qs.dtype == (torch.uint8 if layout.startswith("q4") else torch.int8)
        if qtype in COMPACT:  # compact scales: per row a byte per scale, then a float32 per 256 weights
            scales = cols // per
            for t in (d,) if m is None else (d, m):
                assert t.dtype == torch.uint8 and t.shape == (rows, scales + 4 * (cols // 256))
                assert widen_scales(t, layout).dtype == torch.float32
                assert widen_scales(t, layout).shape == (rows, scales)
        else:
            assert d.dtype == torch.float32 and d.shape == (rows, cols // per)
        assert (m is None) == (layout in ("q4_0", "q8_0") or qtype in (Q.Q6_K, Q.Q3_K))
        assert all(t.is_contiguous() for t in (qs, d) + ((m,) if m is not None else ()))


def test_bad_input_is_a_clear_error():
    with pytest.raises(ValueError, match="qtype: expected one of .*, got IQ2_XXS"):
        unpack(Q.IQ2_XXS, torch.zeros(1, 66, dtype=torch.uint8), (1, 256))
    with pytest.raises(ValueError, match=r"blocks: expected uint8 \[2, 420\] of Q6_K for shape \(2, 512\), got \[2, 200\]"):
        unpack(Q.Q6_K, torch.zeros(2, 200, dtype=torch.uint8), (2, 256 + 256))


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda q: q.name)
def test_packed_embedding_rows_are_ggufs(qtype):
    """A packed matrix looked up as an embedding (the kernels' dequantizer on
    the picked rows, every layout and scale form) gives gguf's values, bit for bit."""
    from paged.backends.cpu.quant_linear import CpuPackedLinear
    from paged.core.models.loaders.packed import PackedBlocks

    rows, cols = 40, 512
    raw = random_blocks(qtype, rows, cols, seed=21)
    lin = CpuPackedLinear(PackedBlocks(qtype, torch.from_numpy(raw), (rows, cols)), "int8x2")
    want = torch.from_numpy(quants.dequantize(raw, qtype).reshape(rows, cols).astype(np.float32))
    ids = torch.tensor([[39, 0, 7], [7, 12, 39]])
    got = lin.embedding(ids)
    assert got.shape == (2, 3, cols) and torch.equal(got.view(torch.int32), want[ids].view(torch.int32))
