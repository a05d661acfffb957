"""q8_0's packed codes (csrc_cpu/linear/q8_packed.h; quant_layouts.pack_q8_codes):
a q8_0 matrix whose codes all lie in -16..15 (GGUF's Q5_0) held in 5 bits
("q8_0.s5"), or whose codes are all IQ4_NL table values held as 4-bit
indices ("q8_0.nl4"; its own form: tests/test_q8_table_codes.py), read in
place by the x86 builds (registers, avx512's persistent panels) and
unpacked per work item by the others.

Oracles: the same matrix with its codes as int8 bytes (the q8_0 form
tests/test_quant_linear_int8.py checks against exact arithmetic), bitwise, on
every path, build and row count this CPU runs; gguf's dequantizer (through
quant_layouts) for the values; the Python packer, written apart from the C++
one, for the bytes."""

from __future__ import annotations

import pytest
import torch

from paged.core.models.loaders.quant_layouts import IQ4_NL_VALUES, pack_q8_codes, q8_code_form, unpack, widen_scales

C = pytest.importorskip("paged._C_cpu")
pytest.importorskip("gguf")

from gguf import GGMLQuantizationType as Q  # noqa: E402

from paged.backends.cpu.attention import dl  # noqa: E402
from paged.core.models.loaders.packed import PackedBlocks  # noqa: E402
from test_compact_scales import linear, same_bits  # noqa: E402  (quant_linear into a NaN-filled out; bitwise ==)
from test_quant_layouts import random_blocks  # noqa: E402
from test_quant_linear import isa  # noqa: E402,F401  (once per linear build this CPU runs)
from test_quant_linear_int8 import rows_alone_equal_in_calls  # noqa: E402
from test_s16_packed_codes import assert_packed_shape_errors, packed_linear_equals_bytes  # noqa: E402


def q8_matrix(n: int, k: int, seed: int, lo: int = -16, hi: int = 15):
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(lo, hi + 1, (n, k), generator=gen, dtype=torch.int32).to(torch.int8)
    codes[0, 0], codes[-1, -1] = lo, hi
    d = (torch.rand(n, k // 32, generator=gen) * 0.02).half().float()  # fp16 values, as GGUF's
    return codes, d


def table_matrix(n: int, k: int, seed: int):
    """q8_0 codes that are all IQ4_NL table values ("q8_0.nl4"), every value present."""
    gen = torch.Generator().manual_seed(seed)
    table = torch.tensor(IQ4_NL_VALUES, dtype=torch.int8)
    codes = table[torch.randint(0, 16, (n, k), generator=gen)]
    codes[0, :16] = table
    d = (torch.rand(n, k // 32, generator=gen) * 0.02).half().float()
    return codes, d


#: both packed forms (q8_packed.h): 5-bit codes, IQ4_NL table indices (tests/test_q8_table_codes.py has its own)
MATRICES = {"q8_0.s5": q8_matrix, "q8_0.nl4": table_matrix}


def panels_of(qtype: str, qs: torch.Tensor, d: torch.Tensor) -> torch.Tensor | None:
    if not C.weight_panel_layout():
        return None
    panels = torch.empty(C.weight_panel_bytes(qtype, dl(qs), dl(d), None), dtype=torch.uint8)
    C.build_weight_panels(qtype, dl(qs), dl(d), None, dl(panels))
    return panels


@pytest.mark.parametrize("lo,hi,form", [(-16, 15, "q8_0.s5"), (-8, 7, "q8_0.s5"), (-17, 15, "q8_0"),
                                        (-16, 16, "q8_0"), (-128, 127, "q8_0")])
def test_pack_round_trips_where_the_codes_fit(lo, hi, form):
    codes, _ = q8_matrix(5, 96, seed=hi - lo, lo=lo, hi=hi)
    qs, qtype = pack_q8_codes(codes)
    assert qtype == form == q8_code_form(codes)
    if form == "q8_0":
        assert qs is codes
        return
    assert qs.dtype == torch.uint8 and qs.shape == (5, 96 // 32 * 20)
    back = torch.empty_like(codes)
    for n in range(5):  # q8_packed.h's layout read back by hand
        for e in range(96):
            blk = qs[n, e // 32 * 20:(e // 32 + 1) * 20].tolist()
            i = e % 32
            u = (blk[i & 15] >> (0 if i < 16 else 4)) & 15 | ((blk[16 + i % 4] >> (i // 4)) & 1) << 4
            back[n, e] = u - 16
    assert torch.equal(back, codes)


@pytest.mark.parametrize("form,bad,expected", [
    ("q8_0.s5", 16, r"codes in \[-16, 15\]"),
    ("q8_0.nl4", 2, r"codes among IQ4_NL's 16 values")])
def test_extension_packs_as_the_python_packer_and_refuses_what_does_not_fit(form, bad, expected):
    codes, _ = MATRICES[form](37, 288, seed=4)
    want, qtype = pack_q8_codes(codes)
    out = torch.empty_like(want)
    C.pack_codes(dl(codes), qtype, dl(out))
    assert qtype == form and torch.equal(out, want)
    codes[3, 40] = bad
    with pytest.raises(ValueError, match=rf"codes: expected {expected} for qtype '{form}', got code {bad} at \[3, 40\]"):
        C.pack_codes(dl(codes), form, dl(out))
    with pytest.raises(ValueError, match="multiple of 32"):
        C.pack_codes(dl(codes[:, :40].contiguous()), form, dl(out))
    with pytest.raises(ValueError, match="qtype"):
        C.pack_codes(dl(codes), "q8_0", dl(out))
    with pytest.raises(ValueError, match="out"):
        C.pack_codes(dl(codes), form, dl(torch.empty(37, 288 // 32 * 24, dtype=torch.uint8)))


@pytest.mark.parametrize("form", MATRICES)
def test_dequantize_packed_equals_bytes(form):
    codes, d = MATRICES[form](37, 160, seed=3)
    qs, qtype = pack_q8_codes(codes)
    assert qtype == form
    want, got = torch.empty(37, 160), torch.empty(37, 160)
    C.quant_dequantize("q8_0", dl(codes), dl(d), None, dl(want))
    C.quant_dequantize(qtype, dl(qs), dl(d), None, dl(got))
    assert same_bits(got, want)


@pytest.mark.parametrize("form", MATRICES)
@pytest.mark.parametrize("rows,n,k", [(1, 70, 96), (2, 33, 288), (3, 45, 896), (8, 37, 160), (9, 65, 96),
                                      (9, 65, 2048), (40, 45, 288)])
@pytest.mark.parametrize("activations", ["float32", "int8", "int8x2"])
def test_linear_packed_equals_bytes(isa, form, rows, n, k, activations):
    """Each build and row count path: the x86 builds read the packed rows
    (few rows from registers; more: the per-call panels and pair tiles built
    from them), scalar unpacks each work item; K not a multiple of 256 (what
    Q5_0 is written for), an odd number of blocks, N not a multiple of the
    32-row work item; a two-term split."""
    codes, d = MATRICES[form](n, k, seed=rows * 31 + n)
    packed_linear_equals_bytes("q8_0", codes, d, None, pack_q8_codes, rows, activations)


@pytest.mark.parametrize("form", MATRICES)
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 9, 33])
@pytest.mark.parametrize("activations", ["int8", "int8x2"])
def test_persistent_panels_of_packed_codes(form, rows, activations):
    """The avx512 panels of packed codes (their transposed dwords: 5 a block,
    or 4 of nibbles for table indices) hold as many bytes as the codes, give
    the byte form's bits at every row count (in place up to 8 rows, widened
    to bytes for the tiles above), and unpack back to the packed arrays bit
    for bit."""
    codes, d = MATRICES[form](77, 288, seed=rows)
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


@pytest.mark.parametrize("form", MATRICES)
def test_rows_alone_equal_rows_in_calls(form):
    """Each row alone (scalar build, 1 thread) == the same rows in calls of
    several sizes, every build, 1 and 2 threads."""
    codes, d = MATRICES[form](130, 896, seed=9)
    qs, qtype = pack_q8_codes(codes)
    x = torch.randn(11, 896, generator=torch.Generator().manual_seed(2))
    rows_alone_equal_in_calls(lambda x, t, qs, d, m: linear(t, x, qs, d, m, "int8x2"), x, qtype, qs, d, None,
                              sizes=(1, 3, 8, 11))


@pytest.mark.parametrize("setting", ["1", "0"])
def test_gguf_q5_0_runs_packed(monkeypatch, setting):
    """CpuPackedLinear holds a Q5_0 matrix in 5 bits (PAGED_Q8_PACKED=1; the
    default packs where the build reads them in place) or as bytes ("0"),
    with the same outputs and gguf's values for its embedding rows."""
    from paged.backends.cpu import quant_linear as ql

    monkeypatch.setenv("PAGED_Q8_PACKED", setting)
    gguf_type_runs_as(Q.Q5_0, "q8_0.s5" if setting == "1" else None, 20 / 32)


def gguf_type_runs_as(gtype, form: str | None, packed_bytes: float, cols: int = 96 * 3) -> None:
    """CpuPackedLinear on random blocks of GGUF type `gtype` (a q8_0 layout)
    holds them in `form` (packed_bytes a weight; None: int8 codes) and gives
    the byte form's outputs (its scales widened to float32) and gguf's values
    for its embedding rows."""
    from paged.backends.cpu import quant_linear as ql

    rows = 48
    blocks = PackedBlocks(gtype, torch.from_numpy(random_blocks(gtype, rows, cols, seed=11)), (rows, cols))
    w = ql.CpuPackedLinear(blocks, activations="int8x2")
    _, codes, d, _ = unpack(gtype, blocks.blocks, (rows, cols))
    assert w.kernel_qtype == (form or "q8_0")
    assert w.qs.numel() == (int(rows * cols * packed_bytes) if form else codes.numel())
    x = torch.randn(5, cols, generator=torch.Generator().manual_seed(1))
    for r in (1, 5):
        assert same_bits(w.linear(x[:r]), linear("q8_0", x[:r], codes, widen_scales(d, "q8_0"), None, "int8x2"))
    ids = torch.tensor([0, 47, 3])
    assert torch.equal(w.embedding(ids), blocks.dequantize(torch.float32)[ids])


@pytest.mark.parametrize("form,setting,choice", [("q8_0.s5", "PAGED_Q8_PACKED", "pack_q8_codes"),
                                                 ("q8_0.nl4", "PAGED_Q8_TABLE", "pack_q8_table")])
def test_bad_setting_and_packed_input_are_one_clear_error(monkeypatch, form, setting, choice):
    from paged.backends.cpu import quant_linear as ql

    monkeypatch.setenv(setting, "yes")
    with pytest.raises(ValueError, match=f"{setting}: expected '0', '1' or 'auto', got 'yes'"):
        getattr(ql, choice)()
    codes, d = MATRICES[form](4, 96, seed=1)
    qs, qtype = pack_q8_codes(codes)
    assert qtype == form
    assert_packed_shape_errors(qtype, qs, codes, d)  # rows not whole blocks, int8 codes, x's width
