"""q8_0 codes held as IQ4_NL table indices (csrc_cpu/linear/q8_packed.h,
"q8_0.nl4"; quant_layouts.pack_q8_codes): a q8_0 matrix whose codes are all
IQ4_NL's 16 values (what GGUF's IQ4_NL unpacks into) keeps a 4-bit index per
code: every x86 build reads them in place (a lookup per step; avx512's
persistent panels of nibbles), scalar and NEON unpack each work item's rows.

Oracles: the same matrix with its codes as int8 bytes (the q8_0 form
tests/test_quant_linear_int8.py checks against exact arithmetic), bitwise, on
every path, build and row count this CPU runs; GGUF's own IQ4_NL bytes (the
packed rows are its blocks' nibbles) and gguf's dequantizer (through
quant_layouts, test_quant_layouts.py) for the values; the Python packer,
written apart from the C++ one, for the bytes."""

from __future__ import annotations

import pytest
import torch

from paged.core.models.loaders.quant_layouts import IQ4_NL_VALUES, pack_q8_codes, q8_code_form, unpack, unpack_q8_codes

C = pytest.importorskip("paged._C_cpu")
pytest.importorskip("gguf")

from gguf import GGMLQuantizationType as Q  # noqa: E402

from paged.backends.cpu.attention import dl  # noqa: E402
from paged.core.models.loaders.packed import PackedBlocks  # noqa: E402
from test_compact_scales import linear, same_bits  # noqa: E402  (quant_linear into a NaN-filled out; bitwise ==)
from test_quant_layouts import random_blocks  # noqa: E402
from test_quant_linear import isa  # noqa: E402,F401  (once per linear build this CPU runs)
from test_quant_linear_int8 import rows_alone_equal_in_calls  # noqa: E402
from test_s16_packed_codes import assert_packed_shape_errors  # noqa: E402

TABLE = torch.tensor(IQ4_NL_VALUES, dtype=torch.int8)


def table_matrix(n: int, k: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    codes = TABLE[torch.randint(0, 16, (n, k), generator=gen)]
    codes[0, :16] = TABLE  # every value present
    d = (torch.rand(n, k // 32, generator=gen) * 0.02).half().float()  # fp16 values, as GGUF's
    return codes, d


def test_packed_rows_are_ggufs_own_iq4_nl_bytes():
    """Random IQ4_NL blocks unpacked to q8_0 codes, then packed: each row is
    the blocks' 16 nibble bytes (byte l: element l low, 16 + l high) as
    GGUF stores them, and unpacking gives the codes back."""
    rows, cols = 9, 96
    blocks = torch.from_numpy(random_blocks(Q.IQ4_NL, rows, cols, seed=2))
    layout, codes, _, _ = unpack(Q.IQ4_NL, blocks, (rows, cols))
    assert layout == "q8_0"
    qs, qtype = pack_q8_codes(codes)
    assert qtype == "q8_0.nl4" == q8_code_form(codes) and qs.shape == (rows, cols // 2)
    gguf_nibbles = blocks.view(torch.uint8).reshape(rows, cols // 32, 18)[..., 2:]  # after each block's fp16 d
    assert torch.equal(qs, gguf_nibbles.reshape(rows, -1))
    assert torch.equal(unpack_q8_codes(qs, qtype), codes)


@pytest.mark.parametrize("case,form", [("table", "q8_0.nl4"), ("one off", "q8_0"), ("five bits", "q8_0.s5"),
                                       ("table off", "q8_0")])
def test_form_is_the_table_only_where_every_code_is_in_it(case, form):
    codes, _ = table_matrix(4, 64, seed=1)
    if case == "one off":
        codes[2, 9] = 2  # not a table value
    if case == "five bits":  # -10, 1, 13 are table values in -16..15: the in-place 5-bit form first
        codes = TABLE[torch.randint(7, 10, (4, 64))]
    assert q8_code_form(codes, table=case != "table off") == form


def test_extension_packs_as_the_python_packer_and_refuses_what_does_not_fit():
    codes, _ = table_matrix(37, 288, seed=4)
    want, qtype = pack_q8_codes(codes)
    out = torch.empty_like(want)
    C.pack_codes(dl(codes), qtype, dl(out))
    assert torch.equal(out, want)
    codes[3, 40] = 2
    with pytest.raises(ValueError, match=r"codes: expected codes among IQ4_NL's 16 values for qtype 'q8_0.nl4', "
                                         r"got code 2 at \[3, 40\]"):
        C.pack_codes(dl(codes), "q8_0.nl4", dl(out))
    with pytest.raises(ValueError, match="multiple of 32"):
        C.pack_codes(dl(codes[:, :40].contiguous()), "q8_0.nl4", dl(out))
    with pytest.raises(ValueError, match="out"):
        C.pack_codes(dl(codes), "q8_0.nl4", dl(torch.empty(37, 288 // 32 * 20, dtype=torch.uint8)))


def test_dequantize_packed_equals_bytes():
    codes, d = table_matrix(37, 160, seed=3)
    qs, qtype = pack_q8_codes(codes)
    want, got = torch.empty(37, 160), torch.empty(37, 160)
    C.quant_dequantize("q8_0", dl(codes), dl(d), None, dl(want))
    C.quant_dequantize(qtype, dl(qs), dl(d), None, dl(got))
    assert same_bits(got, want)


@pytest.mark.parametrize("rows,n,k", [(1, 70, 96), (2, 33, 288), (3, 45, 896), (8, 37, 160), (9, 65, 2048),
                                      (40, 45, 288)])
@pytest.mark.parametrize("activations", ["float32", "int8", "int8x2"])
def test_linear_packed_equals_bytes(isa, rows, n, k, activations):
    """Each build and row count path (the x86 builds read the indices in
    place: direct rows, per-call panels, pair tiles; scalar unpacks each work
    item), an odd number of blocks, N not a multiple of the 32-row work item,
    a two-term split."""
    codes, d = table_matrix(n, k, seed=rows * 31 + n)
    qs, qtype = pack_q8_codes(codes)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    for split in (-1, rows // 2) if activations == "int8x2" else (-1,):
        want = linear("q8_0", x, codes, d, None, activations, split)
        assert same_bits(linear(qtype, x, qs, d, None, activations, split), want)


def test_rows_alone_equal_rows_in_calls():
    """Each row alone (scalar build, 1 thread) == the same rows in calls of
    several sizes, every build, 1 and 2 threads."""
    codes, d = table_matrix(130, 896, seed=9)
    qs, qtype = pack_q8_codes(codes)
    x = torch.randn(11, 896, generator=torch.Generator().manual_seed(2))
    rows_alone_equal_in_calls(lambda x, t, qs, d, m: linear(t, x, qs, d, m, "int8x2"), x, qtype, qs, d, None,
                              sizes=(1, 3, 8, 11))


def panels_of(qtype: str, qs: torch.Tensor, d: torch.Tensor) -> torch.Tensor | None:
    if not C.weight_panel_layout():
        return None
    panels = torch.empty(C.weight_panel_bytes(qtype, dl(qs), dl(d), None), dtype=torch.uint8)
    C.build_weight_panels(qtype, dl(qs), dl(d), None, dl(panels))
    return panels


@pytest.mark.parametrize("rows", [1, 2, 5, 8, 9, 33])
@pytest.mark.parametrize("activations", ["int8", "int8x2"])
def test_persistent_panels_of_table_indices(rows, activations):
    """The avx512 panels of table indices (transposed nibble dwords, as the
    4-bit types'): half the byte panel's codes, the byte form's bits at every
    row count (in place up to 8 rows, widened to bytes for the tiles above),
    and they unpack back to the packed arrays bit for bit."""
    codes, d = table_matrix(77, 288, seed=rows)
    qs, qtype = pack_q8_codes(codes)
    panels = panels_of(qtype, qs, d)
    if panels is None:
        pytest.skip(f"linear build {C.linear_isa()!r} has no weight panels (avx512 / amx: AVX-512 VNNI CPUs)")
    assert panels.numel() < panels_of("q8_0", codes, d).numel()
    x = torch.randn(rows, 288, generator=torch.Generator().manual_seed(rows))
    for split in (-1, rows // 2) if activations == "int8x2" else (-1,):
        want = linear("q8_0", x, codes, d, None, activations, split)
        out = torch.full_like(want, float("nan"))
        C.quant_linear(dl(x), qtype, dl(qs), dl(d), None, dl(out), activations, split, dl(panels))
        assert same_bits(out, want)
    back_qs, back_d = torch.zeros_like(qs), torch.zeros_like(d)
    C.unpack_weight_panels(qtype, dl(panels), dl(back_qs), dl(back_d), None, 0)
    assert torch.equal(back_qs, qs) and torch.equal(back_d, d)


@pytest.mark.parametrize("setting", ["1", "0", "auto"])
def test_gguf_iq4_nl_runs_on_table_indices(monkeypatch, setting):
    """CpuPackedLinear holds an IQ4_NL matrix as its 4-bit indices (half the
    bytes; PAGED_Q8_TABLE=0: int8 codes; the default packs where the build
    reads them in place) and gives the byte form's outputs and gguf's values
    for its embedding rows."""
    from paged.backends.cpu import quant_linear as ql

    monkeypatch.setenv("PAGED_Q8_TABLE", setting)
    packs = setting == "1" or (setting == "auto" and C.linear_reads_q8_table())
    monkeypatch.setenv("PAGED_Q8_PACKED", "0")  # (no 5-bit form either way: IQ4_NL's values pass -16..15)
    rows, cols = 48, 96 * 3
    blocks = PackedBlocks(Q.IQ4_NL, torch.from_numpy(random_blocks(Q.IQ4_NL, rows, cols, seed=11)), (rows, cols))
    w = ql.CpuPackedLinear(blocks, activations="int8x2")
    _, codes, d, _ = unpack(Q.IQ4_NL, blocks.blocks, (rows, cols))
    assert w.kernel_qtype == ("q8_0.nl4" if packs else "q8_0")
    assert w.qs.numel() == (rows * cols // 2 if packs else codes.numel())
    x = torch.randn(5, cols, generator=torch.Generator().manual_seed(1))
    for r in (1, 5):
        assert same_bits(w.linear(x[:r]), linear("q8_0", x[:r], codes, d, None, "int8x2"))
    ids = torch.tensor([0, 47, 3])
    assert torch.equal(w.embedding(ids), blocks.dequantize(torch.float32)[ids])


def test_bad_input_is_one_clear_error(monkeypatch):
    from paged.backends.cpu import quant_linear as ql

    monkeypatch.setenv("PAGED_Q8_TABLE", "yes")
    with pytest.raises(ValueError, match="PAGED_Q8_TABLE: expected '0', '1' or 'auto', got 'yes'"):
        ql.pack_q8_table()
    codes, d = table_matrix(4, 96, seed=1)
    qs, qtype = pack_q8_codes(codes)
    assert_packed_shape_errors(qtype, qs, codes, d)  # rows not whole blocks, int8 codes, x's width
