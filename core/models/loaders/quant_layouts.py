"""GGUF block formats unpacked into the CPU kernels' layouts, exactly.

Every GGUF type llama.cpp's common mixes use maps onto one of these layouts
whose dequantized values are gguf's bit for bit (tests/test_quant_layouts.py
checks each against the ``gguf`` package's dequantizer on random blocks):

=========  ============================================  =====================================
layout     fields                                        w[n, k]
=========  ============================================  =====================================
q4_0       qs uint8 [N, K/2] nibbles, d [N, K/32]        d[b] * (q - 8)
q4_1       qs uint8 [N, K/2] nibbles, d, m [N, K/32]     d[b] * q + m[b]
q8_0       qs int8 [N, K], d [N, K/32]                   d[b] * q
s16        qs int8 [N, K], d [N, K/16], m [N, K/16]      d[h] * q + m[h]   (m may be None: 0)
f16, bf16  qs float16 / bfloat16 [N, K], d, m None     qs[n, k] (exact in float32)
=========  ============================================  =====================================

(b: the 32-value block of k, h: its 16-value half; nibbles low half first,
as GGUF stores them; scales float32.)

GGUF type -> layout: Q4_0, Q4_1, Q8_0 as themselves; IQ4_XS -> q8_0 (IQ4_NL's
values, its per-32 scale d * (ls - 32) exact, compact); Q4_K -> q4_1 (its
per-32 scale and min are d * sc and -dmin * m, exact products), with d and
m in compact form (``compact_scales``: uint8 [N, K/32 + K/64], per row the
6-bit sc / m bytes then the fp16 d / -dmin as float32, one per 256 weights;
the kernels' drivers widen them per work item, csrc_cpu/linear/compact_scales.h;
``widen_scales`` gives the float32 d / m; Q2_K, Q3_K, Q5_K and Q6_K's s16
scales likewise, a byte per 16 weights); Q5_0 and
IQ4_NL -> q8_0 (codes q - 16 and the IQ4_NL table's values); Q2_K, Q3_K,
Q5_1, Q5_K, Q6_K -> s16 (per-16 scales, and mins where the type has them);
F16 and BF16 -> f16 and bf16, their own 16-bit values (a view of the
blocks: no copy, no float32 widening). The CPU's packed linear then holds
s16's codes in 2-6 bits (``pack_s16_codes``; Q2_K's in 2, Q3_K's in 3, Q5_K's in 5, Q6_K's in 6).
Why each is exact: a product of an fp16 scale and a sub-scale of at most 8
bits has at most 19 significant bits (exact in float32), and the layouts
apply the remaining multiply and add in the order gguf's dequantizer does.
"""

from __future__ import annotations

import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

#: GGUF type -> the kernel layout it unpacks to
LAYOUT = {Q.Q4_0: "q4_0", Q.Q4_1: "q4_1", Q.Q8_0: "q8_0", Q.Q4_K: "q4_1", Q.Q5_0: "q8_0", Q.IQ4_NL: "q8_0",
          Q.IQ4_XS: "q8_0",
          Q.Q2_K: "s16", Q.Q3_K: "s16", Q.Q5_1: "s16", Q.Q5_K: "s16", Q.Q6_K: "s16", Q.F16: "f16", Q.BF16: "bf16"}
#: the 16-bit float layouts: float32 activations under every setting (no integer codes to multiply)
HALF_LAYOUTS = {"f16": torch.float16, "bf16": torch.bfloat16}
#: IQ4_NL's code -> value table
IQ4_NL_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def _f16(raw: torch.Tensor) -> torch.Tensor:
    """[..., 2] uint8 little-endian halves -> [...] float32."""
    return raw.contiguous().view(torch.float16).float().squeeze(-1)


def _split(blocks: torch.Tensor, *sizes: int) -> list[torch.Tensor]:
    """A block's byte fields, in order, each [nb, size]."""
    out, at = [], 0
    for s in sizes:
        out.append(blocks[:, at:at + s])
        at += s
    return out


def _nibbles(qs: torch.Tensor, groups: int) -> torch.Tensor:
    """[nb, groups * 16 * x] packed bytes -> codes: per group of 32 bytes' worth, the
    low nibbles are the first half of the values and the high nibbles the
    second (GGUF's order); [nb, 2 * bytes] uint8."""
    nb = qs.shape[0]
    q = qs.reshape(nb, groups, 1, -1)
    return torch.cat([q & 0x0F, q >> 4], dim=2).reshape(nb, -1)


def _bits(mask: torch.Tensor, width: int) -> torch.Tensor:
    """[nb, bytes] -> [nb, bytes * 8 / width... ] the i-th `width`-bit field of
    every byte, fields of one shift consecutive: [nb, 8 // width, bytes]."""
    shifts = torch.arange(0, 8, width, dtype=torch.uint8).view(1, -1, 1)
    return (mask.unsqueeze(1) >> shifts) & ((1 << width) - 1)


def _k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K's 12 scale bytes -> (sc, m), 6 bits each, [nb, 8]."""
    s = scales.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=1)
    return sc, mn


def _q3_k_scales(scales: torch.Tensor) -> torch.Tensor:
    """Q3_K's 12 scale bytes -> 16 signed scales (6 bits, minus 32), [nb, 16]."""
    low = torch.cat([scales[:, :8] & 0x0F, scales[:, :8] >> 4], dim=1)
    high = ((scales[:, 8:12].unsqueeze(1) >> torch.arange(0, 8, 2, dtype=torch.uint8).view(1, -1, 1)) & 3)
    return (low | (high.reshape(-1, 16) << 4)).to(torch.int32) - 32


def _per(rows: int, t: torch.Tensor) -> torch.Tensor:
    return t.reshape(rows, -1).contiguous()


def unpack(qtype: Q, blocks: torch.Tensor, shape: tuple[int, int]):
    """Raw GGUF blocks uint8 [N, row bytes] -> (layout, qs, d, m) for the
    type's layout (module docstring); ValueError for a type it has none for."""
    if qtype not in LAYOUT:
        raise ValueError(f"qtype: expected one of {', '.join(t.name for t in LAYOUT)}, got {qtype.name}")
    n, k = shape
    block, size = GGML_QUANT_SIZES[qtype]
    if k % block or blocks.shape != (n, k // block * size):
        raise ValueError(f"blocks: expected uint8 [{n}, {k // block * size}] of {qtype.name} for shape {shape}, "
                         f"got {list(blocks.shape)}")
    b = blocks.reshape(-1, size)
    return (LAYOUT[qtype], *_UNPACK[qtype](b, n))


def _q4_0(b, n):
    d, qs = _split(b, 2, 16)
    return _per(n, qs), _per(n, _f16(d)), None


def _q4_1(b, n):
    d, m, qs = _split(b, 2, 2, 16)
    return _per(n, qs), _per(n, _f16(d)), _per(n, _f16(m))


def _q8_0(b, n):
    d, qs = _split(b, 2, 32)
    return _per(n, qs.contiguous().view(torch.int8)), _per(n, _f16(d)), None


def _q5_codes(qh: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    """Q5_0 / Q5_1: 4 high-bit bytes + 16 nibble bytes -> 32 codes 0..31."""
    high = _bits(qh, 1).transpose(1, 2).reshape(-1, 32)  # bit j of the little-endian word = value j
    return _nibbles(qs, 1) | (high << 4)


def _q5_0(b, n):
    d, qh, qs = _split(b, 2, 4, 16)
    codes = _q5_codes(qh, qs).to(torch.int8) - 16
    return _per(n, codes), _per(n, _f16(d)), None


def _iq4_nl(b, n):
    d, qs = _split(b, 2, 16)
    table = torch.tensor(IQ4_NL_VALUES, dtype=torch.int8)
    return _per(n, table[_nibbles(qs, 1).long()]), _per(n, _f16(d)), None


def _iq4_xs(b, n):
    # per 256 weights: fp16 d, then each 32-block's 6-bit scale ls (its low 4
    # bits in scales_l, its high 2 in the little-endian uint16 scales_h), then
    # IQ4_NL's nibbles; w = fl(d * (ls - 32)) * value: q8_0 with compact scales
    d, scales_h, scales_l, qs = _split(b, 2, 2, 4, 128)
    low = _bits(scales_l, 4).transpose(1, 2).reshape(-1, 8)  # block i: byte i // 2, nibble i % 2
    high = _bits(scales_h, 2).transpose(1, 2).reshape(-1, 8)  # block i: bits 2i, 2i + 1 of the uint16
    sub = (low | (high << 4)).to(torch.int8) - 32
    table = torch.tensor(IQ4_NL_VALUES, dtype=torch.int8)
    return _per(n, table[_nibbles(qs, 8).long()]), compact_scales(_per(n, _f16(d)), _per(n, sub)), None


def _halves(t: torch.Tensor) -> torch.Tensor:
    """A per-32 value [nb, x] -> per-16 [nb, 2x] (each twice)."""
    return t.repeat_interleave(2, dim=1)


def _q5_1(b, n):
    d, m, qh, qs = _split(b, 2, 2, 4, 16)
    codes = _q5_codes(qh, qs).to(torch.int8)
    return _per(n, codes), _per(n, _halves(_f16(d).unsqueeze(1))), _per(n, _halves(_f16(m).unsqueeze(1)))


def _pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Codes 0..15 [rows, K] -> the q4 layout's bytes [rows, K/2]: per 32
    values, byte j holds value j (low nibble) and value 16 + j (high)."""
    c = codes.reshape(codes.shape[0], -1, 2, 16)
    return (c[:, :, 0] | (c[:, :, 1] << 4)).reshape(codes.shape[0], -1)


#: scales per float32 super value in compact scales (one per 256 weights: csrc_cpu/linear/compact_scales.h)
COMPACT_PER_SUPER = {"q4_1": 8, "q8_0": 8, "s16": 16}


def compact_scales(super_values: torch.Tensor, sub: torch.Tensor) -> torch.Tensor:
    """[N, G] float32 super values and [N, S] signed sub-scales (S a multiple
    of G, each |value| < 128) -> uint8 [N, S + 4 G]: per row the bytes, then
    the floats' bytes (the value of scale i: fl(super[i // (S / G)] * sub[i]))."""
    floats = super_values.to(torch.float32).contiguous().view(torch.uint8).reshape(sub.shape[0], -1)
    return torch.cat([sub.to(torch.int8).view(torch.uint8), floats], dim=1).contiguous()


def widen_scales(t: torch.Tensor | None, layout: str) -> torch.Tensor | None:
    """A layout's compact scales (uint8) -> float32 [N, scales], fl(super *
    sub): the exact values; float32 scales (or None) pass through."""
    if t is None or t.dtype != torch.uint8:
        return t
    per = COMPACT_PER_SUPER[layout]
    count = t.shape[1] * per // (per + 4)  # a row holds `count` bytes and count / per floats
    sub = t[:, :count].contiguous().view(torch.int8).float()
    sup = t[:, count:].contiguous().view(torch.float32)
    return (sup.repeat_interleave(per, dim=1) * sub).contiguous()


def _q4_k(b, n):
    d, dmin, scales, qs = _split(b, 2, 2, 12, 128)
    sc, mn = _k_scale_min(scales)
    codes = _pack_nibbles(_nibbles(qs, 4))
    return (_per(n, codes), compact_scales(_per(n, _f16(d)), _per(n, sc)),
            compact_scales(_per(n, -_f16(dmin)), _per(n, mn)))


def _q5_k(b, n):
    d, dmin, scales, qh, qs = _split(b, 2, 2, 12, 32, 128)
    sc, mn = _k_scale_min(scales)
    high = _bits(qh, 1).reshape(-1, 256)  # shift i (sub-block i) over the 32 values
    codes = (_nibbles(qs, 4) | (high << 4)).to(torch.int8)
    return (_per(n, codes), compact_scales(_per(n, _f16(d)), _per(n, _halves(sc))),
            compact_scales(_per(n, -_f16(dmin)), _per(n, _halves(mn))))


def _q6_k(b, n):
    ql, qh, scales, d = _split(b, 128, 64, 16, 2)
    low = torch.cat([ql.reshape(-1, 2, 1, 64) & 0x0F, ql.reshape(-1, 2, 1, 64) >> 4], dim=2).reshape(-1, 2, 4, 32)
    high = _bits(qh.reshape(-1, 2, 32).reshape(-1, 32), 2).reshape(-1, 2, 4, 32)
    codes = ((low | (high << 4)).to(torch.int8) - 32).reshape(-1, 256)
    return _per(n, codes), compact_scales(_per(n, _f16(d)), _per(n, scales.contiguous().view(torch.int8))), None


def _q3_k(b, n):
    hmask, qs, scales, d = _split(b, 32, 64, 12, 2)
    low = _bits(qs.reshape(-1, 2, 32).reshape(-1, 32), 2).reshape(-1, 2, 4, 32).reshape(-1, 256)
    high = _bits(hmask, 1).reshape(-1, 256)  # shift i: values 32 i .. 32 i + 31
    codes = (low.to(torch.int8) - ((high ^ 1) << 2).to(torch.int8))
    return _per(n, codes), compact_scales(_per(n, _f16(d)), _per(n, _q3_k_scales(scales))), None


def _q2_k(b, n):
    scales, qs, d, dmin = _split(b, 16, 64, 2, 2)
    codes = _bits(qs.reshape(-1, 2, 32).reshape(-1, 32), 2).reshape(-1, 2, 4, 32).reshape(-1, 256)
    return (_per(n, codes.to(torch.int8)), compact_scales(_per(n, _f16(d)), _per(n, scales & 0x0F)),
            compact_scales(_per(n, -_f16(dmin)), _per(n, scales >> 4)))


def _half(dtype: torch.dtype):
    """F16 / BF16: the blocks' bytes viewed as the 16-bit values [N, K]."""
    return lambda b, n: (_per(n, b.contiguous().view(dtype)), None, None)


_UNPACK = {Q.F16: _half(torch.float16), Q.BF16: _half(torch.bfloat16), Q.Q4_0: _q4_0, Q.Q4_1: _q4_1, Q.Q8_0: _q8_0, Q.Q5_0: _q5_0, Q.IQ4_NL: _iq4_nl, Q.IQ4_XS: _iq4_xs, Q.Q5_1: _q5_1,
           Q.Q4_K: _q4_k, Q.Q5_K: _q5_k, Q.Q6_K: _q6_k, Q.Q3_K: _q3_k, Q.Q2_K: _q2_k}


def as_s16(layout: str, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None):
    """Any layout's fields as s16's (int8 codes, per-16 scales and mins), the
    same values: a fused matrix whose parts have different layouts runs as s16
    (not the 16-bit float layouts: ValueError; packed.cat_rows widens those)."""
    if layout in HALF_LAYOUTS:
        raise ValueError(f"layout {layout!r} has no s16 form (its values are not int8 codes times a scale)")
    d, m = widen_scales(d, layout), widen_scales(m, layout)
    if layout == "s16":
        return qs, d, m
    if layout == "q8_0":
        return qs, _halves(d), None
    n = qs.shape[0]
    q = qs.reshape(n, -1, 16)
    codes = torch.cat([q & 0x0F, q >> 4], dim=2).reshape(n, -1)
    if layout == "q4_0":
        return (codes.to(torch.int8) - 8), _halves(d), None
    return codes.to(torch.int8), _halves(d), _halves(m)


#: code bits s16's packed codes may take (csrc_cpu/linear/s16.h, "Packed codes")
PACKED_CODE_BITS = (2, 3, 4, 5, 6)


def _packed_form(lo: int, hi: int, min_bits: int = 2) -> tuple[int, int] | None:
    """(bits, bias) of the fewest bits (at least min_bits) holding codes
    lo..hi, unsigned (bias 0) before signed (bias 2^(bits-1)); None past 6 bits."""
    for bits in PACKED_CODE_BITS:
        for bias in (0, 1 << (bits - 1)):
            if bits >= min_bits and 0 <= lo + bias and hi + bias < (1 << bits):
                return bits, bias
    return None


def s16_code_form(codes: torch.Tensor, min_bits: int = 2) -> str:
    """The kernels' qtype for s16 codes [N, K] packed into the fewest bits
    (at least min_bits) that hold them ("s16.u2" for Q2_K's codes 0..3,
    "s16.s3" for Q3_K's -4..3, "s16.u5" for 0..31, "s16.s6" for -32..31), or
    "s16" (bytes) past 6 bits. For K not a multiple of 256, 5-bit codes
    (Q5_1's 0..31, Q5_0's -16..15) are packed per 32-block ("s16.u5b",
    "s16.s5b": pack_q8_codes' form), other codes stay bytes."""
    form = _packed_form(int(codes.min()), int(codes.max()), min_bits) if codes.numel() else None
    if form is not None and codes.shape[1] % 256:
        form = (5, form[1]) if form[0] <= 5 else None
        return "s16" if form is None else f"s16.{'s' if form[1] else 'u'}5b"
    return "s16" if form is None else f"s16.{'s' if form[1] else 'u'}{form[0]}"


def packed_code_bits(qtype: str) -> tuple[int, int]:
    """(bits, bias) of a packed s16 qtype."""
    bits = int(qtype[5])
    return bits, (1 << (bits - 1)) if qtype[4] == "s" else 0


def pack_s16_codes(codes: torch.Tensor, min_bits: int = 2) -> tuple[torch.Tensor, str]:
    """s16's int8 codes [N, K] packed into the fewest bits (at least
    min_bits) that hold every code (Q2_K's 0..3 in 2, Q3_K's -4..3 in 3,
    Q5_K's 0..31 in 5, Q6_K's -32..31 in 6), as csrc_cpu/linear/s16.h lays
    them out: u = q + bias, per 256 weights (8 blocks of 32) B vectors of
    32 bytes of the low B bits (B = 4 from 4 bits, else 2; vector i, byte l:
    block (8/B) i + j's element l at bit B j) then h = bits - B vectors of
    the high bits (u >> B of block j's element l in byte l of vector j /
    (8/h), at bit h * (j % (8/h))).
    Returns (uint8 [N, K/256 * 32 bits], the kernels' qtype: "s16.u5" for
    codes 0..31, "s16.s6" for -32..31), or (codes, "s16") when they need
    more than 6 bits or K is not a multiple of 256."""
    qtype = s16_code_form(codes, min_bits)
    if qtype == "s16":
        return codes, "s16"
    n, k = codes.shape
    bits, bias = packed_code_bits(qtype)
    if qtype.endswith("b"):
        return _pack_block5(codes, 16 if bias else 0), qtype
    u = (codes.to(torch.int16) + bias).view(n, k // 256, 8, 32)  # [row, group, block, element]
    base = 4 if bits >= 4 else 2
    fields = [_bit_planes(u & ((1 << base) - 1), base)]
    if bits > base:
        fields.append(_bit_planes(u >> base, bits - base))
    return torch.cat(fields, dim=2).reshape(n, -1).contiguous(), f"s16.{'s' if bias else 'u'}{bits}"


def _bit_planes(fields: torch.Tensor, width: int) -> torch.Tensor:
    """Fields of ``width`` bits of 8 blocks [n, g, 8, 32] (int16) as width
    vectors of 32 bytes [n, g, width, 32]: block j in vector j / (8/width)
    at bit width * (j % (8/width))."""
    n, g = fields.shape[:2]
    shifts = (width * torch.arange(8 // width, dtype=torch.int16)).view(1, 1, 1, -1, 1)
    return (fields.view(n, g, width, 8 // width, 32) << shifts).sum(3).to(torch.uint8)


def _from_bit_planes(planes: torch.Tensor, width: int) -> torch.Tensor:
    """_bit_planes' inverse: [n, g, width, 32] uint8 to [n, g, 8, 32] int16."""
    n, g = planes.shape[:2]
    shifts = (width * torch.arange(8 // width, dtype=torch.int16)).view(1, 1, 1, -1, 1)
    fields = (planes.to(torch.int16).unsqueeze(3) >> shifts) & ((1 << width) - 1)
    return fields.reshape(n, g, 8, 32)


def unpack_s16_codes(packed: torch.Tensor, qtype: str) -> torch.Tensor:
    """pack_s16_codes' inverse: int8 codes [N, K] from packed rows of
    ``qtype`` ("s16" returns ``packed`` itself)."""
    if qtype == "s16":
        return packed
    bits, bias = packed_code_bits(qtype)
    n = packed.shape[0]
    if qtype.endswith("b"):  # per 32-block (pack_q8_codes' form)
        v = packed.view(n, -1, 20).to(torch.int16)
        low = torch.cat([v[..., :16] & 15, v[..., :16] >> 4], dim=2)  # elements 0-15, 16-31
        fifth = (v[..., 16:].unsqueeze(2) >> torch.arange(8, dtype=torch.int16).view(8, 1)) & 1  # [n, b, 8, 4]
        return ((low | fifth.reshape(n, -1, 32) << 4) - bias).to(torch.int8).reshape(n, -1)
    v = packed.reshape(n, -1, bits, 32)  # per group: the low bits' vectors, then the high bits'
    base = 4 if bits >= 4 else 2
    u = _from_bit_planes(v[:, :, :base], base)
    if bits > base:
        u |= _from_bit_planes(v[:, :, base:], bits - base) << base
    return (u - bias).to(torch.int8).reshape(n, -1)


def q8_code_form(codes: torch.Tensor, five_bits: bool = True, table: bool = True) -> str:
    """The kernels' qtype for q8_0 codes [N, K]: "q8_0.s5" when every code
    lies in -16..15 (Q5_0's q - 16) and five_bits, "q8_0.nl4" when every code
    is one of IQ4_NL's 16 values and table, else "q8_0" (bytes)."""
    if not codes.numel():
        return "q8_0"
    if five_bits and -16 <= int(codes.min()) and int(codes.max()) <= 15:
        return "q8_0.s5"
    if table and bool(torch.isin(codes, torch.tensor(IQ4_NL_VALUES, dtype=codes.dtype)).all()):
        return "q8_0.nl4"
    return "q8_0"


def pack_q8_codes(codes: torch.Tensor, five_bits: bool = True, table: bool = True) -> tuple[torch.Tensor, str]:
    """q8_0's int8 codes [N, K] packed as csrc_cpu/linear/q8_packed.h lays
    them out (q8_code_form's choice): "q8_0.s5", u = q + 16 in 5 bits, per
    32-block 20 bytes: 16 bytes of nibbles (byte l: element l in bits 0-3,
    element 16 + l in bits 4-7), then 4 bytes of fifth bits (element e's in
    byte e % 4, bit e / 4); "q8_0.nl4", each code's index in IQ4_NL's table,
    16 bytes of such nibbles per 32-block. Returns (uint8 [N, K/32 * 20 or
    K/2], the qtype), or (codes, "q8_0")."""
    qtype = q8_code_form(codes, five_bits, table)
    if qtype == "q8_0":
        return codes, qtype
    if qtype == "q8_0.nl4":
        n, k = codes.shape
        index = torch.full((256,), -1, dtype=torch.int16)
        index[torch.tensor(IQ4_NL_VALUES, dtype=torch.int64) + 128] = torch.arange(16, dtype=torch.int16)
        i = index[codes.to(torch.int64) + 128].view(n, k // 32, 32)
        return (i[..., :16] | (i[..., 16:] << 4)).to(torch.uint8).reshape(n, -1).contiguous(), qtype
    return _pack_block5(codes, 16), qtype


def unpack_q8_codes(packed: torch.Tensor, qtype: str) -> torch.Tensor:
    """pack_q8_codes' inverse: int8 codes [N, K] ("q8_0" returns ``packed``)."""
    if qtype == "q8_0":
        return packed
    n = packed.shape[0]
    if qtype == "q8_0.nl4":  # GGUF's IQ4_NL nibbles (_iq4_nl's lookup)
        table = torch.tensor(IQ4_NL_VALUES, dtype=torch.int8)
        return table[_nibbles(packed.reshape(-1, 16), 1).long()].reshape(n, -1)
    return unpack_s16_codes(packed, "s16.s5b")  # the same 20-byte blocks, bias 16


def _pack_block5(codes: torch.Tensor, bias: int) -> torch.Tensor:
    """Codes [N, K] (u = code + bias in 0..31) in pack_q8_codes' 20-byte blocks."""
    n, k = codes.shape
    u = (codes.to(torch.int16) + bias).view(n, k // 32, 32)
    nibbles = (u[..., :16] & 15) | ((u[..., 16:] & 15) << 4)
    fifth = ((u >> 4).view(n, k // 32, 8, 4) << torch.arange(8, dtype=torch.int16).view(8, 1)).sum(-2)
    return torch.cat([nibbles, fifth], dim=2).to(torch.uint8).reshape(n, -1).contiguous()


def dequantize_layout(layout: str, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None) -> torch.Tensor:
    """The float32 matrix of a layout's fields (w as the module docstring says)."""
    if layout in HALF_LAYOUTS:
        return qs.float()
    codes, scale, mins = as_s16(layout, qs, d, m)
    n, k = codes.shape
    w = codes.float().view(n, -1, 16) * scale.view(n, -1, 1)
    if mins is not None:
        w = w + mins.view(n, -1, 1)
    return w.reshape(n, k)
