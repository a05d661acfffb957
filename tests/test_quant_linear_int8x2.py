"""CPU quantized linear with two-term int8 activations (activations="int8x2").

The contract (csrc_cpu/linear/int8.h, docs/kernels.md): x quantized as the
int8 path does (xq, dx), then the residual's low codes on the fixed scale
s = dx / 256, lo = round_half_even(clamp(fl(x - fl(dx * xq)) / s, +-127)),
so x ~ s * (256 xq + lo); per block the exact int32 isum = W . (256 xq + lo)
and the int8 path's fp32 chain with dx := s: acc = fma(fl(d * s),
float32(isum), acc) (q4_1: acc = fma(m, fl(s * sum c), acc)).
Oracles: that arithmetic emulated in torch (codes bit for bit, the fma chain
exactly in rationals for small shapes, within fp32 rounding for larger ones),
and x @ W^T in float64 within the 16-bit codes' rounding bound, ~250x tighter
than int8's. Invariance: a row's bits are the same alone or in calls of any
M, on 1 or 2 threads, in every build this CPU runs.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch

from paged import _C_cpu as C
from test_quant_linear import QTYPES, dense_parts, random_weight
from test_quant_linear_int8 import (SUPPORTED, build, check_chain, check_dense_bound, codes, exact_case,  # noqa: F401
                                    exact_chain, quantize, rows_alone_equal_in_calls)
from test_quant_linear_int8 import run as run_int8

run = partial(run_int8, activations="int8x2")


def quantize_x2(x: torch.Tensor):
    """The documented two-term quantization in torch float32: (c int64 [M, K]
    = 256 xq + lo, s float32 [M, K/32], xs float32 [M, K/32] = s * sum c)."""
    xq, dx, _ = quantize(x)
    s = dx * 2.0**-8
    rows, k = x.shape
    res = x - dx.repeat_interleave(32, dim=1) * xq.float()  # one rounding per op (torch's CPU kernels)
    sk = s.repeat_interleave(32, dim=1)
    ok = sk > 0
    lo = torch.where(ok, (res / torch.where(ok, sk, 1.0)).clamp(-127, 127).round(), 0.0).to(torch.int64)
    c = 256 * xq + lo
    return c, s, s * c.view(rows, -1, 32).sum(dim=2).float()


def block_terms_x2(x, qtype, qs, d, m):
    """The chain's operands [M, N, nb] as float64: (fl(d * s), float32(isum), (m, xs) or None)."""
    c, s, xs = quantize_x2(x)
    w = codes(qtype, qs)
    nb = w.shape[1] // 32
    isum = torch.einsum("rbk,nbk->rnb", c.view(-1, nb, 32), w.view(-1, nb, 32))  # exact int64
    scale = (d.unsqueeze(0) * s.unsqueeze(1)).double()
    offsets = (m.unsqueeze(0).double(), xs.unsqueeze(1).double()) if qtype == "q4_1" else None
    return scale, isum.to(torch.float32).double(), offsets


def check_unquantized(out, x, qtype, qs, d, m) -> float:
    """|out - x @ W^T| within the 16-bit codes' rounding (s per element:
    s/2, or s where a clamped low code adds one step) plus the chain's fp32
    rounding (isum rounded to float32 included); returns the relative error."""
    _, s, _ = quantize_x2(x)
    step = s.double().repeat_interleave(32, dim=1) * (1 + 2.0**-10)
    return check_dense_bound(out, x, qtype, qs, d, m, step, 3 * x.shape[1] // 32 + 2).item()


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("m_rows,n,k", [(3, 20, 96), (2, 17, 32), (5, 19, 64), (11, 45, 32), (13, 70, 160)])
def test_exact_arithmetic(build, qtype, m_rows, n, k):
    """Bit for bit the documented arithmetic (rational-exact oracle), every
    build; AVX2 multiplies int16 pairs in q8_0 calls of 5 rows (direct) and
    every type's calls of more than 8 (the panel's pair tiles, partial
    tiles of rows and weight rows)."""
    x, qs, d, m = exact_case(qtype, m_rows, n, k)
    assert torch.equal(run(x, qtype, qs, d, m), exact_chain(*block_terms_x2(x, qtype, qs, d, m)))


@pytest.mark.parametrize("qtype", QTYPES)
def test_accuracy(build, qtype):
    """Within fp32 rounding of the emulated chain, within the 16-bit rounding
    bound of x @ W^T, and 100x+ closer to it than int8 alone."""
    gen = torch.Generator().manual_seed(11)
    qs, d, m = random_weight(qtype, 200, 1536, gen)
    x = torch.randn(20, 1536, generator=gen) * torch.rand(20, 1536, generator=gen) ** 4 * 3
    out = run(x, qtype, qs, d, m)
    check_chain(out, *block_terms_x2(x, qtype, qs, d, m))
    assert check_unquantized(out, x, qtype, qs, d, m) < 1e-4
    scaled, offsets = dense_parts(qtype, qs, d, m)
    exact = x.double() @ (scaled + offsets).T
    err_x2 = (out.double() - exact).abs().max().item()
    err_i8 = (run_int8(x, qtype, qs, d, m).double() - exact).abs().max().item()
    assert err_x2 * 100 < err_i8


@pytest.mark.parametrize("qtype", QTYPES)
def test_rows_bitwise_invariant(qtype):
    """Each row alone (scalar build, 1 thread) == the same row in calls of
    M = 2 .. 120 on 1 and 2 threads in every build this CPU runs (direct
    and panel paths, partial tiles)."""
    gen = torch.Generator().manual_seed(7)
    qs, d, m = random_weight(qtype, 72, 320, gen)
    x = torch.randn(120, 320, generator=gen) * torch.rand(120, 1, generator=gen) * 4
    alone = rows_alone_equal_in_calls(run, x, qtype, qs, d, m, (2, 3, 5, 9, 40, 120))
    check_chain(alone, *block_terms_x2(x, qtype, qs, d, m))
    check_unquantized(alone, x, qtype, qs, d, m)


@pytest.mark.parametrize("qtype", QTYPES)
def test_zero_tiny_clamped_and_nonfinite(build, qtype):
    """A zero row gives zeros; subnormal and outlier blocks and residuals at
    the clamp follow the emulation; a NaN or inf makes its own row NaN only."""
    gen = torch.Generator().manual_seed(3)
    qs, d, m = random_weight(qtype, 37, 128, gen)
    x = torch.randn(7, 128, generator=gen)
    x[0] = 0.0
    x[1, 64:96] = 1e-44  # subnormal: dx = 0, the block adds 0
    x[2, 5] = 1e4  # outlier
    x[3, :32] = torch.arange(-16, 16) + 0.5  # hi codes at ties
    x[3, 0] = 127.0
    x[4, :32] = 127.0 / 254.0 * (torch.arange(32) % 2 * 2 - 1)  # residuals near dx/2: low codes at the clamp
    x[4, 0] = 127.0
    x[5, 70] = float("nan")
    x[6, 3] = float("-inf")
    out = run(x, qtype, qs, d, m)
    assert torch.equal(out[0], torch.zeros(37))
    assert torch.equal(out[:5], exact_chain(*block_terms_x2(x[:5], qtype, qs, d, m)))
    assert torch.isnan(out[5:]).all()


def test_layer_stack_int8x2_bitwise_equal_to_python_layers(monkeypatch):
    """The whole-stack runner takes "int8x2" and stays bitwise equal to the
    Python layers; its hidden states are within ~1e-4 of float32's."""
    from paged.backends.cpu.attention import CpuBackend
    from paged.backends.cpu.quant_linear import CpuPackedLinear
    from paged.backends.cpu.worker import prepare_model
    from paged.core.models import build_model
    from test_layer_stack import BLOCK, check_scenario, make_model, tiny_config, tiny_weights

    config = tiny_config()
    weights = tiny_weights(config)
    backend = CpuBackend(config.num_heads, config.num_kv_heads, config.head_dim, BLOCK, torch.float32, "cpu",
                         sliding_window=config.sliding_window)
    model = build_model(config, weights, torch.float32, "cpu", backend,
                        partial(CpuPackedLinear, activations="int8x2"))
    prepare_model(model)
    assert model.layer_stack is not None and model.layer_stack.activations == "int8x2"
    check_scenario(model, backend, monkeypatch, config.vocab_size)
    f32_model, _ = make_model(config, weights)
    x = torch.randn(9, config.hidden_size, generator=torch.Generator().manual_seed(0))
    f32, i8x2 = f32_model.layers[0].gate_up.linear(x), model.layers[0].gate_up.linear(x)
    assert (i8x2 - f32).abs().max() <= 1e-4 * f32.abs().max()
