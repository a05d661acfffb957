"""CPU quantized linear on the s16 layout (int8 codes, a float scale and
optional offset per 16 weights: csrc_cpu/linear/s16.h), the layout the
K-quants with 16-weight scales, Q5_1/Q5_K and fused matrices of mixed types
run in.

Oracles: the documented arithmetic evaluated exactly (each fma of the two
half chains in rationals, rounded once to float32)
for every build this CPU runs, with int8 and int8x2 activations; x @ W^T in
float64 within the rounding of x; a row's bits alone vs in calls of any
size on 1 and 2 threads in every build; real GGUF K-quant blocks (random,
checked against gguf's dequantizer in test_quant_layouts.py) through the
CpuPackedLinear that the engine builds.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from paged import _C_cpu as C
from test_quant_layouts import random_blocks
from test_quant_linear_int8 import quantize, round_f32
from test_quant_linear_int8x2 import quantize_x2

SUPPORTED = C.supported_linear_isas()


def s16_weight(n: int, k: int, seed: int, offsets: bool):
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int32).to(torch.int8)
    d = torch.rand(n, k // 16, generator=gen) * 0.02
    d[0, 1] = 0.0
    m = (torch.randn(n, k // 16, generator=gen) * 0.01) if offsets else None
    return codes, d, m


def run(x, qs, d, m, activations="int8") -> torch.Tensor:
    out = torch.full((x.shape[0], qs.shape[0]), float("nan"))
    C.quant_linear(x, "s16", qs, d, m, out, activations)
    return out


def quantized_x(x: torch.Tensor, activations: str):
    """(c int64 [M, K], scale float32 [M, K/32]) as int8.h quantizes x: the
    codes (256 * xq + lo for int8x2) and the per-block scale they multiply."""
    if activations == "int8":
        xq, dx, _ = quantize(x)
        return xq, dx
    c, s, _ = quantize_x2(x)
    return c, s


def exact_oracle(x, qs, d, m, activations) -> torch.Tensor:
    """s16.h's two chains per output (first and second halves of every
    32-block) and the offsets' eight, each fma evaluated in rationals and
    rounded once to float32."""
    c, scale = quantized_x(x, activations)
    rows, k = c.shape
    n = qs.shape[0]
    w = qs.to(torch.int64)
    out = torch.empty(rows, n)
    for r in range(rows):
        for j in range(n):
            e = [0.0, 0.0]
            for g in range(k // 16):
                dx = np.float32(scale[r, g // 2].item())
                s = float(np.float32(d[j, g].item()) * dx)
                isum = int((w[j, 16 * g:16 * g + 16] * c[r, 16 * g:16 * g + 16]).sum())
                # float(I): exact below 2^24, else rounded (codes this wide do not come from GGUF)
                e[g % 2] = round_f32(Fraction(s) * Fraction(round_f32(Fraction(isum))) + Fraction(e[g % 2]))
            total = np.float32(e[0]) + np.float32(e[1])
            if m is not None:
                t = [0.0] * 8  # eight offset chains: half g in chain g % 8
                for g in range(k // 16):
                    xs = float(np.float32(scale[r, g // 2].item()) * np.float32(int(c[r, 16 * g:16 * g + 16].sum())))
                    t[g % 8] = round_f32(Fraction(float(np.float32(m[j, g].item()))) * Fraction(xs) + Fraction(t[g % 8]))
                t = [np.float32(v) for v in t]
                total = total + (((t[0] + t[4]) + (t[2] + t[6])) + ((t[1] + t[5]) + (t[3] + t[7])))
            out[r, j] = float(total)
    return out


@pytest.fixture(params=SUPPORTED)
def build(request):
    C.set_linear_isa(request.param)
    yield request.param
    C.set_linear_isa("auto")


@pytest.mark.parametrize("activations", ["int8", "int8x2"])
@pytest.mark.parametrize("offsets,k", [(False, 64), (True, 160), (True, 288)])  # 160: 8 offset chains + 2; 288: a group of 8 blocks + 1
@pytest.mark.parametrize("rows", [3, 9])  # AVX2: 3 rows take the few-rows path, 9 the pair panel
def test_exact_arithmetic(build, activations, offsets, k, rows):
    qs, d, m = s16_weight(5, k, seed=3, offsets=offsets)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(9))
    x[1, :32] *= 1e-3
    assert torch.equal(run(x, qs, d, m, activations), exact_oracle(x, qs, d, m, activations))


@pytest.mark.parametrize("activations", ["int8", "int8x2"])
def test_close_to_the_dense_product(activations):
    qs, d, m = s16_weight(40, 256, seed=5, offsets=True)
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(1))
    w = qs.double() * d.double().repeat_interleave(16, dim=1) + m.double().repeat_interleave(16, dim=1)
    want = x.double() @ w.T
    scale = (x.abs().view(4, -1, 32).amax(dim=2) / 127).double().repeat_interleave(32, dim=1)
    step = scale * (0.5 if activations == "int8" else 0.5 / 256 + 2.0**-20)
    bound = step @ w.abs().T + 64 * 2.0**-24 * (x.double().abs() @ w.abs().T)
    assert torch.all((run(x, qs, d, m, activations).double() - want).abs() <= bound)


@pytest.mark.parametrize("activations", ["int8", "int8x2"])
def test_rows_alone_equal_rows_in_calls(activations):
    qs, d, m = s16_weight(70, 96, seed=7, offsets=True)
    x = torch.randn(20, 96, generator=torch.Generator().manual_seed(2))
    threads = torch.get_num_threads()
    try:
        C.set_linear_isa("scalar")
        torch.set_num_threads(1)
        alone = torch.cat([run(x[i:i + 1], qs, d, m, activations) for i in range(20)])
        for name in SUPPORTED:
            C.set_linear_isa(name)
            for t in (1, 2):
                torch.set_num_threads(t)
                for size in (1, 2, 4, 8, 9, 20):  # AVX2: up to 8 rows few-rows units, then pair panels
                    got = torch.cat([run(x[i:i + size], qs, d, m, activations) for i in range(0, 20, size)])
                    assert torch.equal(got, alone), (name, t, size)
    finally:
        C.set_linear_isa("auto")
        torch.set_num_threads(threads)


def test_argument_errors():
    qs, d, m = s16_weight(4, 64, seed=1, offsets=True)
    x, out = torch.randn(2, 64), torch.empty(2, 4)
    with pytest.raises(ValueError, match=r"d: expected shape \[4, 4\]"):
        C.quant_linear(x, "s16", qs, d[:, :2].contiguous(), m, out, "int8")
    with pytest.raises(ValueError, match="activations: expected 'int8' or 'int8x2' for qtype 's16'"):
        C.quant_linear(x, "s16", qs, d, m, out, "float32")
    with pytest.raises(ValueError, match=r"qs: expected dtype int8"):
        C.quant_linear(x, "s16", qs.view(torch.uint8), d, m, out, "int8")
    dense = torch.empty(4, 64)
    C.quant_dequantize("s16", qs, d, m, dense)
    want = qs.float() * d.repeat_interleave(16, dim=1) + m.repeat_interleave(16, dim=1)
    assert torch.equal(dense, want)


@pytest.mark.parametrize("qtype", [Q.Q6_K, Q.Q5_K, Q.Q3_K, Q.Q2_K, Q.Q5_1], ids=lambda q: q.name)
@pytest.mark.parametrize("activations", ["float32", "int8", "int8x2", "mixed"])
def test_gguf_k_quants_through_the_packed_linear(qtype, activations):
    """Random K-quant blocks as the engine holds them (PackedBlocks ->
    CpuPackedLinear): the int8 paths equal the raw kernel on the unpacked
    fields, float32 activations the dense product of gguf's values."""
    from gguf import quants

    from paged.backends.cpu.quant_linear import CpuPackedLinear
    from paged.core.models.loaders.packed import PackedBlocks

    n, k = 24, 512
    raw = random_blocks(qtype, n, k, seed=4)
    packed = PackedBlocks(qtype, torch.from_numpy(raw), (n, k))
    lin = CpuPackedLinear(packed, activations)
    assert lin.qtype == "s16"
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(3))
    got = lin.linear(x)
    w = torch.from_numpy(quants.dequantize(raw, qtype).reshape(n, k).astype(np.float32))
    if activations == "float32":
        assert torch.allclose(got, x @ w.T, rtol=1e-5, atol=1e-5)
    else:
        mode = "int8" if activations == "int8" else "int8x2"  # mixed: two terms outside the one-term layers
        assert torch.equal(got, run(x, *packed.fields(), mode))
    assert torch.equal(lin.embedding(torch.tensor([[3, 0], [23, 3]])), w[torch.tensor([[3, 0], [23, 3]])])
