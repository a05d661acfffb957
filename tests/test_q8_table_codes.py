"""q8_0 codes held as IQ4_NL table indices (csrc_cpu/linear/q8_packed.h,
"q8_0.nl4"; quant_layouts.pack_q8_codes): a q8_0 matrix whose codes are all
IQ4_NL's 16 values (what GGUF's IQ4_NL unpacks into) keeps a 4-bit index per
code: every x86 build reads them in place (a lookup per step; avx512's
persistent panels of nibbles), scalar and NEON unpack each work item's rows.

The arithmetic (every path, build and row count, panels, rows alone and in
calls, against the byte form) is tests/test_q8_packed_codes.py's, run for
both packed forms. Here, the form itself. Oracles: GGUF's own IQ4_NL bytes
(the packed rows are its blocks' nibbles) and gguf's dequantizer (through
quant_layouts, test_quant_layouts.py) for the values; the Python packer,
written apart from the C++ one, for the bytes."""

from __future__ import annotations

import pytest
import torch

from paged.core.models.loaders.quant_layouts import IQ4_NL_VALUES, pack_q8_codes, q8_code_form, unpack, unpack_q8_codes

C = pytest.importorskip("paged._C_cpu")
pytest.importorskip("gguf")

from gguf import GGMLQuantizationType as Q  # noqa: E402

from test_q8_packed_codes import gguf_type_runs_as, table_matrix  # noqa: E402
from test_quant_layouts import random_blocks  # noqa: E402

TABLE = torch.tensor(IQ4_NL_VALUES, dtype=torch.int8)


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


@pytest.mark.parametrize("setting", ["1", "0", "auto"])
def test_gguf_iq4_nl_runs_on_table_indices(monkeypatch, setting):
    """CpuPackedLinear holds an IQ4_NL matrix as its 4-bit indices (half the
    bytes; PAGED_Q8_TABLE=0: int8 codes; the default packs where the build
    reads them in place) and gives the byte form's outputs and gguf's values
    for its embedding rows."""
    monkeypatch.setenv("PAGED_Q8_TABLE", setting)
    packs = setting == "1" or (setting == "auto" and C.linear_reads_q8_table())
    monkeypatch.setenv("PAGED_Q8_PACKED", "0")  # (no 5-bit form either way: IQ4_NL's values pass -16..15)
    gguf_type_runs_as(Q.IQ4_NL, "q8_0.nl4" if packs else None, 0.5)


@pytest.mark.parametrize("setting", ["1", "0"])
def test_gguf_iq4_xs_runs_on_table_indices(monkeypatch, setting):
    """IQ4_XS (IQ4_NL's values, a 6-bit scale per 32 weights times an fp16
    per 256: q8_0 with compact scales) likewise: its indices and compact
    scales, or int8 codes, the outputs of its codes with the scales widened."""
    monkeypatch.setenv("PAGED_Q8_TABLE", setting)
    monkeypatch.setenv("PAGED_Q8_PACKED", "0")
    gguf_type_runs_as(Q.IQ4_XS, "q8_0.nl4" if setting == "1" else None, 0.5, cols=512)
