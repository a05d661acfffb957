"""bfloat16 prompt rows on AMX-BF16 tiles and the "mixed-bf16" linear
activations (docs/kernels.md, "bfloat16 prompt rows (mixed-bf16)").

Oracles, independent of the C++: the product of the bfloat16-rounded x and
weight (torch's own rounding) in float64, which every output must match
within float32 accumulation's bound (the tile unit's summation order inside
a step is its own, so nothing is bitwise against it); a Python
rearrangement of the weight for bf16_linear's tile layout; bf16_linear on
torch's rounding of the dequantized weight, which quant_linear's prompt
rows (tiles made in the kernel from the int8 panels) must equal bitwise;
each row alone for batch invariance (bitwise); and for the model, the pure
modes: rows that generate a token bitwise as int8x2 computes them, the C++
layer stack bitwise the Python layers.

Only CPUs with AMX-BF16 run these (Sapphire Rapids and later Xeons); the
rest skip with the reason, and auto is "mixed" there (tested in
test_mixed_activations.py).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from paged import _C_cpu as C
from test_layer_stack import LENGTHS, MAX_BLOCKS, packed, step
from test_quant_linear import random_weight
from test_mixed_activations import assert_stack_equals_python_on_mixed_steps, model_with, tiny  # noqa: F401 (tiny: fixture)

from paged.backends.cpu import quant_linear as ql
from paged.backends.cpu.quant_linear import CpuPackedLinear
from paged.backends.cpu.host import isa as cpu_isa

pytestmark = pytest.mark.skipif(not C.bf16_prompt_supported(),
                                reason="this CPU (or its OS, or PAGED_CPU_HIDE) offers no AMX-BF16 tiles")


# The mixed-bf16 mode also needs the linear kernels at the avx512 level; a
# run with PAGED_CPU_ISA / PAGED_CPU_HIDE below it keeps only the kernel's
# own tests (bf16_linear) and the refusal checked in test_auto_follows_the_cpu_level.
at_avx512_level = pytest.mark.skipif(not ql.bf16_prompt_supported(),
                                     reason="linear kernels below the avx512 level here: auto is mixed, "
                                            "mixed-bf16 refused")


def tiles(w16: torch.Tensor) -> torch.Tensor:
    t = torch.empty(C.bf16_weight_elems(*w16.shape), dtype=torch.bfloat16)
    C.build_bf16_weight(w16, t)
    return t


def bf16_linear(x: torch.Tensor, t: torch.Tensor, n: int) -> torch.Tensor:
    out = torch.full((x.shape[0], n), float("nan"))
    C.bf16_linear(x, t, out)
    return out


def random_case(seed: int, m: int, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A bfloat16 weight [n, k] (~0.05 scale) and float32 rows x [m, k]."""
    gen = torch.Generator().manual_seed(seed)
    w16 = (torch.randn(n, k, generator=gen) * 0.05).bfloat16()
    return w16, torch.randn(m, k, generator=gen)


def check_bound(x: torch.Tensor, w16: torch.Tensor, out: torch.Tensor) -> None:
    """|out - bf16(x) @ W16^T| <= (K/32 + 32) * 2^-24 * |bf16(x)| @ |W16|^T
    in float64: products of two bfloat16 values are exact in float32, so
    only the float32 sums round (at most one rounding per step into the
    accumulator and ~log2(32) inside a step's 32 products; the bound is
    generous at 32)."""
    xb, wb = x.bfloat16().double(), w16.double()
    k = x.shape[1]
    bound = (k / 32 + 32) * 2.0**-24 * (xb.abs() @ wb.abs().T)
    err = (out.double() - xb @ wb.T).abs()
    assert bool((err <= bound).all()), f"max error / bound {float((err / bound.clamp_min(1e-300)).max()):.3g}"


@pytest.mark.parametrize("m,n,k", [(1, 16, 32), (5, 40, 64), (16, 32, 96), (17, 33, 96), (32, 32, 32),
                                   (33, 100, 576), (64, 576, 1536), (300, 960, 576)])
def test_within_float32_sums_of_the_bf16_product(m, n, k):
    w16, x = random_case(m * 1000 + n + k, m, n, k)
    x = x * 3
    check_bound(x, w16, bf16_linear(x, tiles(w16), n))


def test_tile_layout_is_the_documented_rearrangement():
    """[c16][s][kk][n][j] = W[16 c16 + n][32 s + 2 kk + j], zero rows past N."""
    n, k = 40, 96
    w16 = torch.randn(n, k).bfloat16()
    padded = torch.zeros(C.bf16_weight_elems(n, k) // k, k, dtype=torch.bfloat16)
    padded[:n] = w16
    want = padded.view(-1, 16, k // 32, 16, 2).permute(0, 2, 3, 1, 4).reshape(-1)
    assert torch.equal(tiles(w16).view(torch.int16), want.view(torch.int16))


def test_x_is_rounded_as_torch_rounds():
    """Values that sit on bfloat16 rounding ties and near them: out equals
    torch's rounding of x times a one-hot weight (exact products, one term)."""
    k = 64
    base = torch.tensor([1.0, -3.0, 1.5, 2.0**-10], dtype=torch.float32)
    bits = base.view(torch.int32)
    near = torch.cat([(bits + d).view(torch.float32) for d in (0x7FFF, 0x8000, 0x8001, 0x18000, -1)])
    x = torch.zeros(1, k)
    x[0, :near.numel()] = near
    w16 = torch.eye(k, dtype=torch.bfloat16)
    out = bf16_linear(x, tiles(w16), k)
    assert torch.equal(out, x.bfloat16().float())


def test_rows_are_bitwise_the_same_alone_and_in_any_call():
    """Batch invariance: each row alone vs calls of many sizes, 1 and 2 threads."""
    n, k = 96, 576
    w16, x = random_case(7, 70, n, k)
    t = tiles(w16)
    alone = torch.cat([bf16_linear(x[r:r + 1].contiguous(), t, n) for r in range(x.shape[0])])
    threads = torch.get_num_threads()
    try:
        for nt in sorted({1, min(2, threads)}):
            torch.set_num_threads(nt)
            for m in (2, 15, 16, 17, 31, 32, 33, 70):
                assert torch.equal(bf16_linear(x[:m].contiguous(), t, n), alone[:m]), (nt, m)
    finally:
        torch.set_num_threads(threads)


def test_non_finite_rows_stay_in_their_row():
    n, k = 32, 64
    w16, x = random_case(2, 4, n, k)
    t = tiles(w16)
    clean = bf16_linear(x, t, n)
    x[1, 5], x[2, 40] = float("nan"), float("inf")
    out = bf16_linear(x, t, n)
    assert out[1].isnan().all() and not out[2].isfinite().any()
    assert torch.equal(out[[0, 3]], clean[[0, 3]])


def test_bad_arguments_are_value_errors():
    w16 = torch.randn(32, 64).bfloat16()
    t = tiles(w16)
    with pytest.raises(ValueError, match=r"weight: expected 2048 elements"):
        C.bf16_linear(torch.randn(2, 64), t[:-1].contiguous(), torch.empty(2, 32))
    with pytest.raises(ValueError, match=r"x: expected dtype float32, got dtype bfloat16"):
        C.bf16_linear(torch.randn(2, 64).bfloat16(), t, torch.empty(2, 32))
    with pytest.raises(ValueError, match=r"out: expected shape \[2, N\]"):
        C.bf16_linear(torch.randn(2, 64), t, torch.empty(3, 32))
    with pytest.raises(ValueError, match=r"x: expected shape \[M, K\] with M >= 1 and K a positive multiple of 32"):
        C.bf16_linear(torch.randn(2, 48), t, torch.empty(2, 32))
    with pytest.raises(ValueError, match=r"w16: expected dtype bfloat16, got dtype float32"):
        C.build_bf16_weight(torch.randn(32, 64), t)
    with pytest.raises(ValueError, match=r"out: expected 2048 elements"):
        C.build_bf16_weight(w16, torch.empty(100, dtype=torch.bfloat16))


# -- the "mixed-bf16" activations -------------------------------------------


@pytest.mark.parametrize("qtype,n,k", [("q4_1", 64, 128), ("q4_0", 40, 96), ("q8_0", 72, 64), ("q4_1", 576, 1536)])
@pytest.mark.parametrize("source", ["panels", "per-call"])
@at_avx512_level
def test_split_linear_is_int8x2_rows_then_bf16_rows(qtype, n, k, source):
    """CpuPackedLinear("mixed-bf16"), one quant_linear call with prompt_rows
    "bf16": rows before first_prompt_row bitwise int8x2's, the rest bitwise
    bf16_linear on torch's bfloat16 rounding of quant_dequantize's weight,
    whose tiles the kernel makes itself from the int8 panels (persistent or
    built per call); QKV (kv_projection) the same; unmarked rows all
    int8x2."""
    from gguf import GGMLQuantizationType

    gtype = {"q4_0": GGMLQuantizationType.Q4_0, "q4_1": GGMLQuantizationType.Q4_1,
             "q8_0": GGMLQuantizationType.Q8_0}[qtype]
    w = CpuPackedLinear(packed(np.random.default_rng(n + k), n, k, gtype), activations="mixed-bf16")
    w.use_panels = source == "panels"
    qs, d, m = w.qs, w.d, w.m
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(41, k, generator=gen)
    int8x2 = torch.empty(41, n)
    C.quant_linear(x, qtype, qs, d, m, int8x2, "int8x2")
    dense = torch.empty(n, k)
    C.quant_dequantize(qtype, qs, d, m, dense)
    bf = bf16_linear(x, tiles(dense.bfloat16()), n)
    for split in (0, 3, 17, 40):
        for kv in (False, True):
            got = w.linear(x, first_prompt_row=split, kv_projection=kv)
            assert torch.equal(got[:split], int8x2[:split]) and torch.equal(got[split:], bf[split:]), (split, kv)
    assert torch.equal(w.linear(x), int8x2)


def test_prompt_rows_argument_errors():
    gen = torch.Generator().manual_seed(1)
    qs, d, m = random_weight("q8_0", 8, 64, gen)
    x, out = torch.randn(3, 64), torch.empty(3, 8)
    with pytest.raises(ValueError, match=r"prompt_rows: expected 'int8' or 'bf16', got 'fp8'"):
        C.quant_linear(x, "q8_0", qs, d, m, out, "int8x2", 1, None, "fp8")
    with pytest.raises(ValueError, match=r"prompt_rows: expected 'int8' with activations 'int8'"):
        C.quant_linear(x, "q8_0", qs, d, m, out, "int8", -1, None, "bf16")


@at_avx512_level
def test_stack_equals_python_layers_and_unmarked_rows_are_int8x2(tiny, monkeypatch):
    config, weights = tiny
    model, backend = model_with("mixed-bf16", config, weights)
    assert model.layer_stack is not None and model.layer_stack.activations == "mixed-bf16"
    assert_stack_equals_python_on_mixed_steps(model, backend, config, monkeypatch)
    rng = np.random.default_rng(5)
    tokens = [rng.integers(0, 96, size=n + 12).tolist() for n in LENGTHS]
    # no rows marked: the int8x2 model's bits; every row a prompt row: not them
    int8x2, xb = model_with("int8x2", config, weights)
    ids, pos, meta = step(tokens, [(0, 0, 3), (1, 0, 17), (2, 0, 9), (3, 0, 20), (4, 0, 5)], 0)
    fresh = lambda b: b.allocate_kv_cache(config.num_layers, len(LENGTHS) * MAX_BLOCKS)  # noqa: E731
    want = int8x2(ids, pos, fresh(xb), meta)
    assert torch.equal(model(ids, pos, fresh(backend), meta), want)
    meta.first_prompt_row = 0
    assert not torch.equal(model(ids, pos, fresh(backend), meta), want)


def test_auto_follows_the_cpu_level():
    """auto is mixed-bf16 here (mixed when PAGED_CPU_ISA runs the linear
    kernels below avx512); capped at the avx2 level (an older CPU), mixed,
    and mixed-bf16 itself is refused with a reason."""
    level_ok = C.linear_isa() in ("avx512", "amx")
    assert ql.resolve_activations("auto") == ("mixed-bf16" if level_ok else "mixed")
    with cpu_isa.use_level("avx2"):
        assert ql.resolve_activations("auto") == "mixed"
        with pytest.raises(ValueError, match="'mixed-bf16' needs AMX-BF16 tiles"):
            ql.resolve_activations("mixed-bf16")
