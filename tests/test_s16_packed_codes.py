"""s16's packed codes (csrc_cpu/linear/s16.h, "Packed codes";
quant_layouts.pack_s16_codes): the int8 codes of an s16 matrix held in the
fewest bits (2-6) that hold them, read directly by the AVX2 kernel in calls
of 1-3 rows and unpacked by the driver per work item otherwise.

Oracles: the same matrix with its codes as int8 bytes (the form
tests/test_quant_linear_s16.py checks against exact arithmetic), bitwise,
on every path, build and thread count this CPU runs; gguf's dequantizer
(through quant_layouts, test_quant_layouts.py) for the values; the Python
unpacker, written apart from the C++ ones, for the bytes."""

from __future__ import annotations

import pytest
import torch

from paged.core.models.loaders.quant_layouts import pack_s16_codes, unpack, unpack_s16_codes

C = pytest.importorskip("paged._C_cpu")
pytest.importorskip("gguf")

from gguf import GGMLQuantizationType as Q  # noqa: E402

from paged.backends.cpu.attention import dl  # noqa: E402
from paged.core.models.loaders.packed import PackedBlocks  # noqa: E402
from test_compact_scales import linear, same_bits  # noqa: E402  (quant_linear into a NaN-filled out; bitwise ==)
from test_quant_layouts import random_blocks  # noqa: E402
from test_quant_linear import isa  # noqa: E402,F401  (once per linear build this CPU runs)
from test_quant_linear_int8 import rows_alone_equal_in_calls  # noqa: E402

# code range -> the form that must hold it (fewest bits; unsigned before signed)
FORMS = [((0, 3), "s16.u2"), ((-2, 1), "s16.s2"), ((0, 7), "s16.u3"), ((-4, 3), "s16.s3"), ((-3, 3), "s16.s3"),
         ((0, 15), "s16.u4"), ((-8, 7), "s16.s4"), ((-5, 3), "s16.s4"), ((0, 31), "s16.u5"),
         ((-16, 15), "s16.s5"), ((0, 63), "s16.u6"), ((-32, 31), "s16.s6"), ((-9, 7), "s16.s5"),
         ((-33, 31), "s16"), ((0, 64), "s16"), ((-128, 127), "s16")]


def codes_in(lo: int, hi: int, n: int, k: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    c = torch.randint(lo, hi + 1, (n, k), generator=gen, dtype=torch.int32).to(torch.int8)
    c[0, 0], c[-1, -1] = lo, hi  # both ends present: they decide the form
    return c


def s16_matrix(lo: int, hi: int, n: int, k: int, seed: int, offsets: bool):
    gen = torch.Generator().manual_seed(seed + 1)
    d = torch.rand(n, k // 16, generator=gen) * 0.02
    m = torch.randn(n, k // 16, generator=gen) * 0.01 if offsets else None
    return codes_in(lo, hi, n, k, seed), d, m


@pytest.mark.parametrize("span,form", FORMS, ids=[f for _, f in FORMS])
def test_pack_takes_the_fewest_bits_and_round_trips(span, form):
    codes = codes_in(*span, 5, 512, seed=span[0] * 7 + span[1])
    qs, qtype = pack_s16_codes(codes)
    assert qtype == form
    if form == "s16":
        assert qs is codes
        return
    bits = int(form[-1])
    assert qs.dtype == torch.uint8 and qs.shape == (5, 512 // 256 * 32 * bits)
    assert torch.equal(unpack_s16_codes(qs, qtype), codes)


@pytest.mark.parametrize("span,form", [((0, 3), "s16.u4"), ((-4, 3), "s16.s4"), ((0, 31), "s16.u5")], ids=str)
def test_narrow_codes_stay_in_four_bits_when_asked(span, form):
    """min_bits=4 (PAGED_S16_NARROW=0, for paired timing) packs 2- and
    3-bit codes in 4 bits as before, wider ones as always."""
    codes = codes_in(*span, 3, 256, seed=4)
    qs, qtype = pack_s16_codes(codes, min_bits=4)
    assert qtype == form and torch.equal(unpack_s16_codes(qs, qtype), codes)


@pytest.mark.parametrize("span,form", [f for f in FORMS if f[1] != "s16"], ids=[f for _, f in FORMS if f != "s16"])
def test_extension_packs_as_the_python_packer(span, form):
    """_C_cpu.pack_codes (what CpuPackedLinear loads with) == the
    Python packer written from s16.h's comment, byte for byte."""
    codes = codes_in(*span, 37, 768, seed=5)
    want, qtype = pack_s16_codes(codes)
    out = torch.empty_like(want)
    C.pack_codes(dl(codes), qtype, dl(out))
    assert qtype == form and torch.equal(out, want)


def test_extension_packer_refuses_what_the_form_cannot_hold():
    codes = codes_in(0, 31, 3, 256, seed=6)
    out = torch.empty(3, 160, dtype=torch.uint8)
    codes[2, 77] = 32
    with pytest.raises(ValueError, match=r"codes: expected codes in \[0, 31\] for qtype 's16.u5', got code 32 at \[2, 77\]"):
        C.pack_codes(dl(codes), "s16.u5", dl(out))
    with pytest.raises(ValueError, match="qtype"):
        C.pack_codes(dl(codes), "s16", dl(out))
    with pytest.raises(ValueError, match="multiple of 256"):
        C.pack_codes(dl(codes[:, :96].contiguous()), "s16.u5", dl(out))
    with pytest.raises(ValueError, match="out"):
        C.pack_codes(dl(codes), "s16.u6", dl(out))


@pytest.mark.parametrize("span,form", [((0, 31), "s16.u5b"), ((-16, 15), "s16.s5b"), ((0, 15), "s16.u5b"),
                                       ((0, 3), "s16.u5b"), ((-4, 3), "s16.s5b"),
                                       ((0, 63), "s16"), ((-32, 31), "s16")], ids=str)
def test_rows_not_whole_groups_pack_per_block_or_stay_bytes(span, form):
    """K = 288: packed groups are 256 weights, so 5-bit codes (Q5_1's, Q5_0's
    there) pack per 32-block (q8_packed.h's form) and wider ones stay bytes."""
    codes = codes_in(*span, 3, 288, seed=2)
    qs, qtype = pack_s16_codes(codes)
    assert qtype == form
    if form == "s16":
        assert qs is codes
        return
    assert qs.shape == (3, 288 // 32 * 20) and torch.equal(unpack_s16_codes(qs, qtype), codes)
    out = torch.empty_like(qs)
    C.pack_codes(dl(codes), qtype, dl(out))
    assert torch.equal(out, qs)


def test_packed_layout_is_the_documented_bytes():
    """s16.h's layout spelled out on one group of 256: nibble vector i,
    byte l = block 2i's element l (low) and block 2i + 1's (high); then (6
    bits: two high bits a code, four blocks a vector) high vector v, byte l,
    bits 2f, 2f + 1 = u >> 4 of block 4v + f's element l; u = code + bias."""
    u = (torch.arange(256, dtype=torch.int16) * 7 + 3) % 64  # every bit of 6 used
    qs, qtype = pack_s16_codes((u - 32).to(torch.int8).view(1, 256))
    assert qtype == "s16.s6"
    blk = lambda j, lane: int(u[32 * j + lane])  # noqa: E731
    want = [blk(2 * i, lane) & 15 | (blk(2 * i + 1, lane) & 15) << 4 for i in range(4) for lane in range(32)]
    want += [sum((blk(4 * v + f, lane) >> 4) << (2 * f) for f in range(4)) for v in range(2) for lane in range(32)]
    assert qs.view(-1).tolist() == want


def test_packed_narrow_layout_is_the_documented_bytes():
    """Below 4 bits (s16.h): two vectors of 2-bit fields (vector i, byte l,
    bits 2j, 2j + 1 = u & 3 of block 4i + j's element l), then for 3 bits
    one vector of the third bits (byte l, bit j = u >> 2 of block j's
    element l)."""
    u = (torch.arange(256, dtype=torch.int16) * 5 + 1) % 8
    for bits, codes in ((3, u - 4), (2, (u & 3) - 2)):
        qs, qtype = pack_s16_codes(codes.to(torch.int8).view(1, 256))
        assert qtype == f"s16.s{bits}"
        v = (codes + (1 << (bits - 1))).tolist()
        want = [sum((v[32 * (4 * i + j) + lane] & 3) << (2 * j) for j in range(4)) for i in range(2) for lane in range(32)]
        if bits == 3:
            want += [sum((v[32 * j + lane] >> 2) << j for j in range(8)) for lane in range(32)]
        assert qs.view(-1).tolist() == want


@pytest.mark.parametrize("span", [(0, 31), (-32, 31), (-4, 3), (0, 3), (0, 63)], ids=str)
@pytest.mark.parametrize("offsets", [False, True], ids=["no_m", "m"])
def test_dequantize_packed_equals_int8_codes(span, offsets):
    codes, d, m = s16_matrix(*span, 37, 256, seed=3, offsets=offsets)
    qs, qtype = pack_s16_codes(codes)
    want, got = torch.empty(37, 256), torch.empty(37, 256)
    C.quant_dequantize("s16", dl(codes), dl(d), None if m is None else dl(m), dl(want))
    C.quant_dequantize(qtype, dl(qs), dl(d), None if m is None else dl(m), dl(got))
    assert same_bits(got, want)


@pytest.mark.parametrize("span", [(0, 31), (-32, 31), (-8, 7), (0, 63), (0, 3), (-4, 3)], ids=str)
@pytest.mark.parametrize("rows,n,k", [(1, 70, 256), (2, 9, 512), (3, 33, 768), (4, 40, 256), (8, 37, 512),
                                      (11, 65, 512), (40, 45, 256)])
@pytest.mark.parametrize("activations", ["int8", "int8x2"])
@pytest.mark.parametrize("offsets", [False, True], ids=["no_m", "m"])
def test_linear_packed_equals_int8_codes(isa, span, rows, n, k, activations, offsets):
    """Every row count path (1-8 rows: read packed by AVX2, unpacked 4
    weight rows at a time by scalar; more: pair panels of a work item's
    unpacked rows), unsigned and signed codes, and a two-term split."""
    codes, d, m = s16_matrix(*span, n, k, seed=rows * 31 + n, offsets=offsets)
    packed_linear_equals_bytes("s16", codes, d, m, pack_s16_codes, rows, activations)


def packed_linear_equals_bytes(layout: str, codes, d, m, pack, rows: int, activations: str) -> None:
    """quant_linear on ``pack(codes)`` == on the byte codes of ``layout``,
    bitwise, for `rows` random rows of x (and, for int8x2, a two-term split)."""
    qs, qtype = pack(codes)
    x = torch.randn(rows, codes.shape[1], generator=torch.Generator().manual_seed(rows))
    for split in (-1, rows // 2) if activations == "int8x2" else (-1,):
        want = linear(layout, x, codes, d, m, activations, split)
        assert same_bits(linear(qtype, x, qs, d, m, activations, split), want)


def test_linear_packed_rows_alone_equal_rows_in_calls():
    """Each row alone (scalar build, 1 thread) == the same rows in calls of
    several sizes, every build, 1 and 2 threads."""
    codes, d, m = s16_matrix(0, 31, 130, 512, seed=9, offsets=True)
    qs, qtype = pack_s16_codes(codes)
    x = torch.randn(7, 512, generator=torch.Generator().manual_seed(2))
    rows_alone_equal_in_calls(lambda x, t, qs, d, m: linear(t, x, qs, d, m, "int8x2"), x, qtype, qs, d, m,
                              sizes=(1, 2, 7))


@pytest.mark.parametrize("qtype,form", [(Q.Q5_K, "s16.u5"), (Q.Q6_K, "s16.s6"), (Q.Q3_K, "s16.s3"),
                                        (Q.Q2_K, "s16.u2"), (Q.Q5_1, "s16.u5")], ids=lambda v: getattr(v, "name", v))
def test_gguf_k_quants_run_packed(qtype, form):
    """The engine's CpuPackedLinear packs each type's codes into its bits,
    holds fewer bytes, and computes the int8-codes matrix's bits; its
    embedding rows are gguf's values."""
    from paged.backends.cpu import quant_linear as ql

    rows, cols = 48, 512
    blocks = PackedBlocks(qtype, torch.from_numpy(random_blocks(qtype, rows, cols, seed=11)), (rows, cols))
    w = ql.CpuPackedLinear(blocks, activations="int8x2")
    assert w.kernel_qtype == form
    _, codes, d, m = unpack(qtype, blocks.blocks, (rows, cols))
    assert w.qs.numel() < codes.numel() and torch.equal(unpack_s16_codes(w.qs, form), codes)
    x = torch.randn(5, cols, generator=torch.Generator().manual_seed(1))
    for r in (1, 5):
        assert same_bits(w.linear(x[:r]), linear("s16", x[:r], codes, d, m, "int8x2"))
    ids = torch.tensor([0, 47, 3])
    assert torch.equal(w.embedding(ids), blocks.dequantize(torch.float32)[ids])


def assert_packed_shape_errors(qtype: str, qs: torch.Tensor, codes: torch.Tensor, d: torch.Tensor) -> None:
    """quant_linear on packed codes of `qtype`: a row that is not whole
    groups, int8 codes named as packed, and an x whose width is not the
    packed row's K are each one ValueError naming the argument."""
    n, k = codes.shape
    out, x = torch.empty(1, n), torch.randn(1, k)
    with pytest.raises(ValueError, match="qs"):
        C.quant_linear(dl(x), qtype, dl(qs[:, :-1].contiguous()), dl(d), None, dl(out), "int8")
    with pytest.raises(ValueError, match="qs"):
        C.quant_linear(dl(x), qtype, dl(codes), dl(d), None, dl(out), "int8")
    with pytest.raises(ValueError, match="x"):
        C.quant_linear(dl(torch.randn(1, 2 * k)), qtype, dl(qs), dl(d), None, dl(out), "int8")


def test_bad_packed_input_is_one_clear_error():
    codes, d, _ = s16_matrix(0, 31, 4, 256, seed=1, offsets=False)
    qs, qtype = pack_s16_codes(codes)
    with pytest.raises(ValueError, match="qtype"):
        C.quant_linear(dl(torch.randn(1, 256)), "s16.u7", dl(qs), dl(d), None, dl(torch.empty(1, 4)), "int8")
    assert_packed_shape_errors(qtype, qs, codes, d)


def half_pair_matrix(lo: int, hi: int, n: int, k: int, seed: int, offsets: bool):
    """s16 codes with each block's two halves on one fp16 scale (and offset),
    as Q5_1 / Q5_0 unpack: (codes, float32 [N, K/16] d, m, fp16 [N, K/32] d, m)."""
    gen = torch.Generator().manual_seed(seed + 1)
    d16 = (torch.rand(n, k // 32, generator=gen) * 0.02).half()
    m16 = (torch.randn(n, k // 32, generator=gen) * 0.01).half() if offsets else None
    wide = lambda t: None if t is None else t.float().repeat_interleave(2, dim=1).contiguous()  # noqa: E731
    return codes_in(lo, hi, n, k, seed), wide(d16), wide(m16), d16, m16


@pytest.mark.parametrize("span", [(0, 31), (-16, 15)], ids=str)
@pytest.mark.parametrize("rows,n,k", [(1, 70, 288), (3, 33, 896), (8, 37, 96), (11, 65, 288), (40, 45, 160)])
@pytest.mark.parametrize("activations", ["int8", "int8x2"])
@pytest.mark.parametrize("offsets", [False, True], ids=["no_m", "m"])
def test_block_packed_codes_and_half_pairs_equal_bytes(isa, span, rows, n, k, activations, offsets):
    """Rows whose K is not a multiple of 256: codes packed per 32-block (read
    in place by the x86 few-rows kernel, unpacked per work item otherwise)
    and fp16 half-pair scales (widened per work item) give the bits of int8
    codes with float32 scales per 16, alone or in any combination."""
    codes, d, m, d16, m16 = half_pair_matrix(*span, n, k, seed=rows * 7 + n, offsets=offsets)
    qs, qtype = pack_s16_codes(codes)
    assert qtype.endswith("5b")
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    for split in (-1, rows // 2) if activations == "int8x2" else (-1,):
        want = linear("s16", x, codes, d, m, activations, split)
        assert same_bits(linear(qtype, x, qs, d, m, activations, split), want)
        assert same_bits(linear("s16", x, codes, d16, m16, activations, split), want)
        assert same_bits(linear(qtype, x, qs, d16, m16, activations, split), want)
    got = torch.empty(n, k)
    C.quant_dequantize(qtype, dl(qs), dl(d16), None if m16 is None else dl(m16), dl(got))
    want = torch.empty(n, k)
    C.quant_dequantize("s16", dl(codes), dl(d), None if m is None else dl(m), dl(want))
    assert same_bits(got, want)


def test_gguf_q5_1_rows_not_whole_groups_run_packed():
    """A Q5_1 matrix whose K is not a multiple of 256 (llama.cpp's fallback
    for Q5_K there) keeps its codes in 5 bits per block and its d and m as
    fp16 pairs: half the bytes of int8 codes with float32 scales
    per 16, the same outputs, gguf's values as embedding rows."""
    from paged.backends.cpu import quant_linear as ql

    rows, cols = 48, 288
    blocks = PackedBlocks(Q.Q5_1, torch.from_numpy(random_blocks(Q.Q5_1, rows, cols, seed=11)), (rows, cols))
    _, codes, d, m = unpack(Q.Q5_1, blocks.blocks, (rows, cols))
    w = ql.CpuPackedLinear(blocks, activations="int8x2")
    assert w.kernel_qtype == "s16.u5b" and w.d.dtype == torch.float16 and w.d.shape == (rows, cols // 32)
    held = sum(t.numel() * t.element_size() for t in (w.qs, w.d, w.m))
    assert held * 2 == sum(t.numel() * t.element_size() for t in (codes, d, m))  # 0.75 bytes a weight, not 1.5
    x = torch.randn(5, cols, generator=torch.Generator().manual_seed(1))
    for r in (1, 5):
        assert same_bits(w.linear(x[:r]), linear("s16", x[:r], codes, d, m, "int8x2"))
    ids = torch.tensor([0, 47, 3])
    assert torch.equal(w.embedding(ids), blocks.dequantize(torch.float32)[ids])


def test_half_pairs_only_where_exact():
    from paged.backends.cpu.quant_linear import _half_pairs

    _, d, m, d16, m16 = half_pair_matrix(0, 31, 4, 96, seed=3, offsets=True)
    hd, hm = _half_pairs(d, m)
    assert torch.equal(hd, d16) and torch.equal(hm, m16)
    d[1, 3] += 1e-3  # halves that differ, or a value fp16 cannot hold: float32 kept
    assert _half_pairs(d, m) == (d, m)
    d2 = d.clone()
    d2[1, 3] = d2[1, 2] = 0.1
    assert _half_pairs(d2, None)[0] is d2


def test_block_packed_and_half_pair_errors():
    codes, d, m, d16, m16 = half_pair_matrix(0, 31, 4, 96, seed=5, offsets=True)
    qs, qtype = pack_s16_codes(codes)
    x, out = torch.randn(1, 96), torch.empty(1, 4)
    with pytest.raises(ValueError, match=r"d: expected shape \[4, 3\], got shape \[4, 2\] \(fp16 half-pair scales"):
        C.quant_linear(dl(x), qtype, dl(qs), dl(d16[:, :2].contiguous()), dl(m16), dl(out), "int8")
    with pytest.raises(ValueError, match="m: expected dtype float16"):
        C.quant_linear(dl(x), qtype, dl(qs), dl(d16), dl(m), dl(out), "int8")
    with pytest.raises(ValueError, match="qs"):  # a row that is not whole blocks of 20 bytes
        C.quant_linear(dl(x), qtype, dl(qs[:, :-1].contiguous()), dl(d16), dl(m16), dl(out), "int8")
    if C.weight_panel_layout():
        with pytest.raises(ValueError, match="no panel layout"):
            C.weight_panel_bytes(qtype, dl(qs), dl(d16), dl(m16))
