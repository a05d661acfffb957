"""CPU quantized linear with two-term int8 activations (activations="int8x2").

The contract (csrc_cpu/linear/quant_linear.cpp, docs/kernels.md): row r of x
is quantized as the int8 path does (xq, dx), the residual
res = fl(x - fl(dx * xq)) is quantized the same way, each term goes through
the int8 arithmetic as a row of its own, and out = fl(term0 + term1).
Oracles: that definition built from the int8 path itself (whose arithmetic
tests/test_quant_linear_int8.py checks against an exact rational oracle), the
residual computed in torch; and x @ W^T in float64 within the two-term
rounding bound, about 250x tighter than int8's. Invariance: a row's bits are
the same alone or in calls of any M, on 1 or 2 threads, in every build.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch

from paged import _C_cpu as C
from test_quant_linear import QTYPES, dense_parts, random_weight
from test_quant_linear_int8 import SUPPORTED, quantize, run as run_int8


def run(x, qtype, qs, d, m) -> torch.Tensor:
    out = torch.full((x.shape[0], qs.shape[0]), float("nan"))
    C.quant_linear(x, qtype, qs, d, m, out, "int8x2")
    return out


def residual(x: torch.Tensor) -> torch.Tensor:
    """x - dx * xq in float32, one rounding per operation (torch's CPU ops)."""
    xq, dx, _ = quantize(x)
    return x - dx.repeat_interleave(32, dim=1) * xq.float()


def oracle(x, qtype, qs, d, m) -> torch.Tensor:
    return run_int8(x, qtype, qs, d, m) + run_int8(residual(x), qtype, qs, d, m)


def check_unquantized(out, x, qtype, qs, d, m) -> float:
    """|out - x @ W^T| within the residual's int8 rounding (dx2 / 2 per
    element, dx2 the residual's block scale) plus fp32 rounding of the two
    chains; returns the relative error."""
    scaled, offsets = dense_parts(qtype, qs, d, m)
    w = scaled + offsets
    _, dx2, _ = quantize(residual(x))
    step = dx2.double().repeat_interleave(32, dim=1) * (0.5 + 2.0**-17)
    exact = x.double() @ w.T
    size = x.double().abs() @ w.abs().T
    bound = step @ w.abs().T + (4 * x.shape[1] // 32 + 4) * 2.0**-24 * size
    err = (out.double() - exact).abs()
    assert torch.all(err <= bound), f"max excess {(err - bound).max().item()}"
    return (err.max() / size.max()).item()


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("m_rows,n,k", [(1, 45, 96), (5, 200, 576), (40, 33, 1536)])
def test_two_terms_as_defined(qtype, m_rows, n, k):
    """Bitwise the sum of the two int8 terms, in every build; 100x+ closer to
    x @ W^T than int8 alone."""
    gen = torch.Generator().manual_seed(m_rows * n + k)
    qs, d, m = random_weight(qtype, n, k, gen)
    x = torch.randn(m_rows, k, generator=gen) * torch.rand(m_rows, k, generator=gen) ** 4 * 3
    try:
        for name in SUPPORTED:
            C.set_linear_isa(name)
            assert torch.equal(run(x, qtype, qs, d, m), oracle(x, qtype, qs, d, m)), name
    finally:
        C.set_linear_isa("auto")
    out = run(x, qtype, qs, d, m)
    scaled, offsets = dense_parts(qtype, qs, d, m)
    exact = x.double() @ (scaled + offsets).T
    err2 = (out.double() - exact).abs().max().item()
    err1 = (run_int8(x, qtype, qs, d, m).double() - exact).abs().max().item()
    assert err2 * 100 < err1
    assert check_unquantized(out, x, qtype, qs, d, m) < 1e-4


@pytest.mark.parametrize("qtype", QTYPES)
def test_rows_bitwise_invariant(qtype):
    """Each row alone (scalar build, 1 thread) == the same row in calls of
    M = 2 .. 120 on 1 and 2 threads in every build this CPU runs."""
    gen = torch.Generator().manual_seed(7)
    qs, d, m = random_weight(qtype, 72, 320, gen)
    x = torch.randn(120, 320, generator=gen) * torch.rand(120, 1, generator=gen) * 4
    threads = torch.get_num_threads()
    try:
        C.set_linear_isa("scalar")
        torch.set_num_threads(1)
        alone = torch.cat([run(x[i : i + 1], qtype, qs, d, m) for i in range(120)])
        for name in SUPPORTED:
            C.set_linear_isa(name)
            for t in (1, 2):
                torch.set_num_threads(t)
                for size in (2, 3, 5, 9, 40, 120):
                    out = torch.cat([run(x[i : i + size], qtype, qs, d, m) for i in range(0, 120, size)])
                    assert torch.equal(out, alone), f"build={name} threads={t} M={size}"
    finally:
        C.set_linear_isa("auto")
        torch.set_num_threads(threads)
    check_unquantized(alone, x, qtype, qs, d, m)


@pytest.mark.parametrize("qtype", QTYPES)
def test_zero_and_nonfinite_rows(qtype):
    """A zero row gives zeros, a NaN or inf makes its own row NaN only."""
    gen = torch.Generator().manual_seed(3)
    qs, d, m = random_weight(qtype, 37, 128, gen)
    x = torch.randn(4, 128, generator=gen)
    x[0] = 0.0
    x[2, 70] = float("nan")
    x[3, 3] = float("-inf")
    out = run(x, qtype, qs, d, m)
    assert torch.equal(out[0], torch.zeros(37))
    assert torch.equal(out[1], run(x[1:2], qtype, qs, d, m)[0]) and torch.isnan(out[2:]).all()


def test_layer_stack_int8x2_bitwise_equal_to_python_layers(monkeypatch):
    """The whole-stack runner takes "int8x2" and stays bitwise equal to the
    Python layers; its hidden states are within ~1e-4 of float32's."""
    from paged.backends.cpu import CpuBackend
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
