"""K-quant scales in compact form (csrc_cpu/linear/compact_scales.h,
quant_layouts.compact_scales): a byte per scale and a float32 per 256
weights, widened by the drivers per work item (Q4_K's q4_1 scales and
offsets; IQ4_XS's q8_0 scales; Q2_K, Q3_K, Q5_K and Q6_K's s16 ones). Oracle: the same weight with the
float32 d / m the widening gives (quant_layouts.widen_scales, itself checked
against gguf's dequantizer in test_quant_layouts), bitwise, on every path
and every build this CPU runs."""

from __future__ import annotations

import pytest
import torch

from paged.core.models.loaders.quant_layouts import unpack, widen_scales

C = pytest.importorskip("paged._C_cpu")
pytest.importorskip("gguf")

from gguf import GGMLQuantizationType as Q  # noqa: E402

from paged.backends.cpu.attention import dl  # noqa: E402
from test_quant_layouts import random_blocks  # noqa: E402
from test_quant_linear import isa  # noqa: E402,F401  (once per linear build this CPU runs)


LAYOUT = {Q.Q4_K: "q4_1", Q.Q6_K: "s16", Q.Q5_K: "s16", Q.Q3_K: "s16", Q.Q2_K: "s16", Q.IQ4_XS: "q8_0"}


def weight(qtype, rows: int, cols: int, seed: int):
    layout, qs, d, m = unpack(qtype, torch.from_numpy(random_blocks(qtype, rows, cols, seed)), (rows, cols))
    assert layout == LAYOUT[qtype] and d.dtype == torch.uint8 and (m is None or m.dtype == torch.uint8)
    return layout, qs, d, m


def widened(layout, d, m):
    return widen_scales(d, layout), widen_scales(m, layout)


def linear(layout, x, qs, d, m, activations, two_term_rows=-1):
    out = torch.full((x.shape[0], qs.shape[0]), float("nan"))
    C.quant_linear(dl(x), layout, dl(qs), dl(d), None if m is None else dl(m), dl(out), activations, two_term_rows)
    return out


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.parametrize("qtype", list(LAYOUT), ids=lambda q: q.name)
@pytest.mark.parametrize("rows,n,k", [(1, 70, 256), (2, 33, 512), (3, 96, 768), (11, 64, 1024), (40, 45, 256)])
@pytest.mark.parametrize("activations", ["float32", "int8", "int8x2"])
def test_compact_scales_equal_their_widened_floats(isa, qtype, rows, n, k, activations):
    layout, qs, d, m = weight(qtype, n, k, seed=rows + n + k)
    if layout == "s16" and activations == "float32":
        pytest.skip("s16 has no float32-activation kernel (it dequantizes: test_dequantize_widens_compact_scales)")
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows * k))
    want = linear(layout, x, qs, *widened(layout, d, m), activations)
    assert torch.isfinite(want).all()
    assert same_bits(linear(layout, x, qs, d, m, activations), want)
    if activations == "int8x2" and rows > 1:  # two-term rows beside one-term rows in one call
        split = rows // 2
        assert same_bits(linear(layout, x, qs, d, m, activations, split),
                         linear(layout, x, qs, *widened(layout, d, m), activations, split))


@pytest.mark.parametrize("qtype", list(LAYOUT), ids=lambda q: q.name)
def test_dequantize_widens_compact_scales(qtype):
    from gguf import quants

    layout, qs, d, m = weight(qtype, 40, 512, seed=9)
    got = torch.empty(40, 512)
    C.quant_dequantize(layout, dl(qs), dl(d), None if m is None else dl(m), dl(got))
    raw = random_blocks(qtype, 40, 512, 9)
    assert same_bits(got, torch.from_numpy(quants.dequantize(raw, qtype).reshape(40, 512).astype("float32")))


@pytest.mark.parametrize("qtype,codes", [(Q.Q4_K, "q4_1"), (Q.IQ4_XS, "q8_0"), (Q.IQ4_XS, "q8_0.nl4")])
def test_weight_panels_keep_compact_scales(qtype, codes):
    """Persistent panels of compact scales keep them compact (a byte per block and
    the supers, widened in registers): every call with them is bitwise the call
    on the widened float32 scales, with that weight's own panels and without.
    IQ4_XS's codes as bytes and as its own table indices (q8_0.nl4)."""
    if not C.weight_panel_layout():
        pytest.skip("the active linear build has no persistent weight panels (avx512 only)")
    layout, qs, d, m = weight(qtype, 40, 512, seed=9)
    wd, wm = widened(layout, d, m)
    if codes != layout:
        packed = torch.empty(40, 256, dtype=torch.uint8)
        C.pack_codes(dl(qs), codes, dl(packed))
        qs, layout = packed, codes

    def panels(d_, m_):
        out = torch.empty(C.weight_panel_bytes(layout, dl(qs), dl(d_), dl(m_)), dtype=torch.uint8)
        C.build_weight_panels(layout, dl(qs), dl(d_), dl(m_), dl(out))
        return out

    compact, wide = panels(d, m), panels(wd, wm)
    assert compact.numel() < wide.numel()  # a byte a block and 4 a super-block per row and scale, not 4 a block
    gen = torch.Generator().manual_seed(4)
    for rows in (1, 3, 8, 9, 20):  # in place from registers up to 8 rows, the tiles above
        x = torch.randn(rows, 512, generator=gen)
        for act in ("int8", "int8x2"):
            want = linear(layout, x, qs, wd, wm, act)
            for args in ((d, m, compact), (wd, wm, wide)):
                out = torch.full((rows, 40), float("nan"))
                C.quant_linear(dl(x), layout, dl(qs), dl(args[0]), dl(args[1]), dl(out), act, -1, dl(args[2]))
                assert same_bits(out, want), (rows, act, args[2].numel())


def test_compact_scales_bad_input_is_one_clear_error():
    layout, qs, d, m = weight(Q.Q4_K, 8, 256, seed=1)
    x, out = torch.randn(2, 256), torch.empty(2, 8)
    with pytest.raises(ValueError, match="m: expected dtype uint8, got dtype float32"):
        C.quant_linear(dl(x), layout, dl(qs), dl(d), dl(widen_scales(m, layout)), dl(out), "int8")
    with pytest.raises(ValueError, match="m: expected compact offsets beside compact scales"):
        C.quant_linear(dl(x), layout, dl(qs), dl(d), None, dl(out), "int8")
    with pytest.raises(ValueError, match="d: expected .*compact scales"):
        C.quant_linear(dl(x), layout, dl(qs), dl(d[:, :-1].contiguous()), dl(m), dl(out), "int8")
    iq_layout, iq_qs, iq_d, _ = weight(Q.IQ4_XS, 8, 256, seed=1)  # q8_0 has no offsets, compact or not
    with pytest.raises(ValueError, match="m: expected None or empty for qtype 'q8_0'"):
        C.quant_linear(dl(x), iq_layout, dl(iq_qs), dl(iq_d), dl(iq_d), dl(out), "int8")
    qs32 = torch.zeros(8, 16, dtype=torch.uint8)  # K = 32: no 256-weight groups
    with pytest.raises(ValueError, match="d: expected float32 scales for K not a multiple of 256"):
        C.quant_linear(dl(torch.randn(2, 32)), layout, dl(qs32), dl(torch.zeros(8, 1, dtype=torch.uint8)),
                       dl(torch.zeros(8, 1, dtype=torch.uint8)), dl(out), "int8")
