"""Persistent int8 weight panels (issue #15; csrc_cpu/linear/weight_panels.h).

The avx512 int8 kernel's per-call panel of widened codes and transposed
scales, built once per matrix: quant_linear with ``panels`` must return
bitwise what it returns without (the oracle is the uncached kernel, itself
tested against the scalar build and the dense reference in
test_quant_linear_int8.py), the tensor must be refused under another build,
shape or size, and the engine's greedy output must not change."""

from __future__ import annotations

import pytest
import torch
from test_quant_linear import QTYPES, random_weight

from paged import _C_cpu as C

pytestmark = pytest.mark.skipif("avx512" not in C.supported_linear_isas(),
                                reason="this CPU lacks AVX-512 F/BW/VL/DQ + AVX512_VNNI: only the avx512 build "
                                       "has weight panels")


@pytest.fixture
def avx512():
    C.set_linear_isa("avx512")
    yield
    C.set_linear_isa("auto")


def build(qtype, qs, d, m) -> torch.Tensor:
    panels = torch.empty(C.weight_panel_bytes(qtype, qs, d, m), dtype=torch.uint8)
    C.build_weight_panels(qtype, qs, d, m, panels)
    return panels


def call(x, qtype, qs, d, m, activations, two_term_rows=-1, panels=None) -> torch.Tensor:
    out = torch.full((x.shape[0], qs.shape[0]), float("nan"))
    C.quant_linear(x, qtype, qs, d, m, out, activations, two_term_rows, panels)
    return out


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("n", [96, 72])  # whole chunks of 32 rows, and a partial last chunk
def test_cached_panels_are_bitwise_the_per_call_panels(avx512, qtype, n):
    gen = torch.Generator().manual_seed(3)
    qs, d, m = random_weight(qtype, n, 8 * 32 + 64, gen)  # 10 blocks: transposes of 16 and the scalar rest
    panels = build(qtype, qs, d, m)
    assert C.weight_panel_layout() == "avx512/1"
    for rows in (1, 4, 8, 9, 16, 33, 100):
        x = torch.randn(rows, d.shape[1] * 32, generator=gen) * 2
        for act, split in (("int8", -1), ("int8x2", -1), ("int8x2", rows // 3)):
            want = call(x, qtype, qs, d, m, act, split)
            got = call(x, qtype, qs, d, m, act, split, panels)
            assert torch.equal(got, want), (rows, act, split)


def test_refused_under_another_build_weight_or_size(avx512):
    gen = torch.Generator().manual_seed(5)
    qs, d, m = random_weight("q4_1", 64, 128, gen)
    panels = build("q4_1", qs, d, m)
    x = torch.randn(12, 128, generator=gen)
    with pytest.raises(ValueError, match=r"panels: expected \d+ bytes for this weight"):
        call(x, "q4_1", qs, d, m, "int8", panels=panels[:-64])
    with pytest.raises(ValueError, match="panels: expected 64-byte aligned data"):
        call(x, "q4_1", qs, d, m, "int8", panels=torch.empty(panels.numel() + 1, dtype=torch.uint8)[1:])
    with pytest.raises(ValueError, match="panels: expected a 1-D uint8 tensor"):
        call(x, "q4_1", qs, d, m, "int8", panels=panels.view(torch.int8))
    same_size = torch.zeros_like(panels)
    with pytest.raises(ValueError, match="panels: expected panels built for this weight under linear ISA 'avx512'"):
        call(x, "q4_1", qs, d, m, "int8", panels=same_size)
    # A same-shape matrix's panels pass the header check (the caller keeps the
    # two together) and are what the kernel reads: the results are theirs.
    qs2, d2, m2 = random_weight("q4_1", 64, 128, gen)
    assert not torch.equal(call(x, "q4_1", qs2, d2, m2, "int8", panels=panels), call(x, "q4_1", qs2, d2, m2, "int8"))
    for name in C.supported_linear_isas():
        if name == "avx512":
            continue
        C.set_linear_isa(name)
        assert C.weight_panel_layout() == ""
        with pytest.raises(ValueError, match=f"linear ISA: expected a build with weight panels .*got '{name}'"):
            call(x, "q4_1", qs, d, m, "int8", panels=panels)
        with pytest.raises(ValueError, match="linear ISA: expected a build with weight panels"):
            C.weight_panel_bytes("q4_1", qs, d, m)
    # float32 activations ignore them
    C.set_linear_isa("avx512")
    assert torch.equal(call(x, "q4_1", qs, d, m, "float32", panels=panels), call(x, "q4_1", qs, d, m, "float32"))
