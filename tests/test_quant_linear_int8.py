"""CPU quantized linear with int8 activations (quant_linear(..., activations="int8")).

The contract (csrc_cpu/linear/int8.h, docs/kernels.md): x quantized per
32-block to int8 (dx = max|x| / 127, xq = round_half_even(clamp(x / dx, +-127))),
exact int32 block dot products isum, then per output over the blocks in order
acc = fma(fl(d * dx), isum, acc) (q4_1: then acc = fma(m, fl(dx * sum xq), acc)).
Oracles: that arithmetic emulated in torch (the quantization bit for bit, the
fma chain exactly in rationals for small shapes, in float64 within fp32
rounding for large ones), and x @ W^T in float64 within the int8 rounding
bound. Invariance: a row's bits are the same alone or in calls of any M, on 1
or 2 threads, in every build this CPU runs (the scalar build is the
reference).
"""

from __future__ import annotations

import os
import subprocess
import sys
from fractions import Fraction
from functools import partial

import numpy as np
import pytest
import torch

from paged import _C_cpu as C
from test_quant_linear import QTYPES, dense_parts, gguf_packed, random_weight

BUILDS = ["scalar", "avx2", "avxvnni", "avx512", "amx"]
SUPPORTED = C.supported_linear_isas()
NEEDS = {"avx2": "AVX2 + FMA", "avxvnni": "AVX-VNNI (Alder Lake, Sapphire Rapids and later; Zen 5)",
         "avx512": "AVX-512 F/BW/VL/DQ + AVX512_VNNI",
         "amx": "AMX-INT8 with AVX512_VNNI, and the kernel's grant of the tile state (Linux 5.16+)"}
OFFSET = {"q4_0": 8, "q4_1": 0, "q8_0": 128}


@pytest.fixture(params=BUILDS)
def build(request):
    if request.param not in SUPPORTED:
        pytest.skip(f"this CPU lacks {NEEDS[request.param]} (build '{request.param}')")
    C.set_linear_isa(request.param)
    yield request.param
    C.set_linear_isa("auto")


def run(x, qtype, qs, d, m, activations="int8") -> torch.Tensor:
    out = torch.full((x.shape[0], qs.shape[0]), float("nan"))
    C.quant_linear(x, qtype, qs, d, m, out, activations)
    return out


def codes(qtype, qs) -> torch.Tensor:
    """Signed integer weight codes [N, K] (q - 8, q, the int8 code) as int64."""
    n = qs.shape[0]
    if qtype == "q8_0":
        return qs.to(torch.int64)
    b = qs.to(torch.int64).view(n, -1, 16)
    q = torch.cat([b & 0x0F, b >> 4], dim=2).reshape(n, -1)
    return q - 8 if qtype == "q4_0" else q


def quantize(x: torch.Tensor):
    """The documented int8 quantization in torch float32: (xq int64 [M, K],
    dx float32 [M, K/32], xs float32 [M, K/32] = dx * sum xq); a block with a
    NaN / inf gets dx = NaN and codes 0."""
    blocks = x.float().view(x.shape[0], -1, 32)
    amax = blocks.abs().amax(dim=2)
    finite = torch.isfinite(blocks).all(dim=2)
    dx = torch.where(finite, amax / 127.0, torch.full_like(amax, float("nan")))
    ok = (finite & (dx > 0)).unsqueeze(2)
    q = torch.where(ok, (blocks / torch.where(ok, dx.unsqueeze(2), 1.0)).clamp(-127, 127).round(), 0.0)
    xq = q.to(torch.int64)
    return xq.reshape(x.shape), dx, dx * xq.sum(dim=2).float()


def block_terms(x, qtype, qs, d, m):
    """Per (r, n, b) the two fp32 fma operands pairs of the documented chain:
    (fl(d * dx), isum) and, for q4_1, (m, xs); as float64 tensors [M, N, nb]."""
    xq, dx, xs = quantize(x)
    w = codes(qtype, qs)
    nb = w.shape[1] // 32
    isum = torch.einsum("rbk,nbk->rnb", xq.view(-1, nb, 32).double(), w.view(-1, nb, 32).double())
    scale = (d.unsqueeze(0) * dx.unsqueeze(1)).double()  # float32 products, rounded as the kernel's
    offsets = (m.unsqueeze(0).double(), xs.unsqueeze(1).double()) if qtype == "q4_1" else None
    return scale, isum, offsets


def round_f32(v: Fraction) -> float:
    """v rounded to float32, to nearest, ties to even (exact: the neighbours
    of a double-rounded guess are compared as rationals)."""
    if v == 0:
        return 0.0
    guess = np.float32(float(v))
    cands = [guess, np.nextafter(guess, np.float32(-np.inf)), np.nextafter(guess, np.float32(np.inf))]
    best = min(abs(Fraction(float(c)) - v) for c in cands)
    ties = [c for c in cands if abs(Fraction(float(c)) - v) == best]
    return float(min(ties, key=lambda c: int(np.array(c).view(np.uint32)) & 1))


def exact_oracle(x, qtype, qs, d, m) -> torch.Tensor:
    """The documented arithmetic evaluated exactly: every fma of the chain in
    rationals, rounded once to float32."""
    return exact_chain(*block_terms(x, qtype, qs, d, m))


def exact_chain(scale, isum, offsets) -> torch.Tensor:
    """acc = fma(scale, isum, acc) (then fma(m, xs, acc)) over the blocks, each
    fma exact in rationals and rounded once to float32."""
    rows, cols, nb = isum.shape
    out = torch.empty(rows, cols)
    for r in range(rows):
        for n in range(cols):
            acc = 0.0
            for b in range(nb):
                acc = round_f32(Fraction(scale[r, n, b].item()) * int(isum[r, n, b]) + Fraction(acc))
                if offsets is not None:
                    acc = round_f32(Fraction(offsets[0][0, n, b].item()) * Fraction(offsets[1][r, 0, b].item())
                                    + Fraction(acc))
            out[r, n] = acc
    return out


def check_emulation(out, x, qtype, qs, d, m):
    """out against the float64 sum of the chain's terms: within the chain's
    fp32 rounding, one 2^-24 per fma of |terms|."""
    check_chain(out, *block_terms(x, qtype, qs, d, m))


def check_chain(out, scale, isum, offsets):
    """out against the float64 sum of the chain's terms (exact_chain's
    arguments), within one 2^-24 per fma of |terms|."""
    terms = scale * isum
    if offsets is not None:
        terms = torch.cat([terms, offsets[0] * offsets[1]], dim=2)
    tol = terms.shape[2] * 2.0**-24 * terms.abs().sum(dim=2)
    err = (out.double() - terms.sum(dim=2)).abs()
    assert torch.all(err <= tol + 1e-30), f"max excess {(err - tol).max().item()}"


def check_unquantized(out, x, qtype, qs, d, m) -> torch.Tensor:
    """|out - x @ W^T| (float64, W dequantized) within the int8 rounding of x,
    sum_k |W[n, k]| * dx * (1/2 + 2^-17) (a code is within 1/2 of fl(x / dx),
    itself within 128 * 2^-24 of x / dx), plus the chain's fp32 rounding.
    Returns the relative error."""
    _, dx, _ = quantize(x)
    return check_dense_bound(out, x, qtype, qs, d, m, dx.double().repeat_interleave(32, dim=1) * (0.5 + 2.0**-17),
                             2 * x.shape[1] // 32 + 2)


def check_dense_bound(out, x, qtype, qs, d, m, step, fmas) -> torch.Tensor:
    """|out - x @ W^T| (float64, W dequantized) within step @ |W|^T (step
    [M, K]: how far the quantized x may be from x) plus `fmas` fp32
    roundings of |x| @ |W|^T. Returns the relative error."""
    scaled, offsets = dense_parts(qtype, qs, d, m)
    w = scaled + offsets
    exact = x.double() @ w.T
    size = x.double().abs() @ w.abs().T
    bound = step @ w.abs().T + fmas * 2.0**-24 * size
    err = (out.double() - exact).abs()
    assert torch.all(err <= bound), f"max excess {(err - bound).max().item()}"
    return err.max() / size.max()


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("m_rows,n,k", [(3, 20, 96), (2, 17, 32)])
def test_exact_arithmetic(build, qtype, m_rows, n, k):
    """Bit for bit the documented arithmetic (rational-exact oracle), every build."""
    x, qs, d, m = exact_case(qtype, m_rows, n, k)
    assert torch.equal(run(x, qtype, qs, d, m), exact_oracle(x, qtype, qs, d, m))


def exact_case(qtype, m_rows, n, k):
    """(x, qs, d, m) for the rational-exact checks: blocks of different scales."""
    gen = torch.Generator().manual_seed(n + k)
    qs, d, m = random_weight(qtype, n, k, gen)
    x = torch.randn(m_rows, k, generator=gen)
    x[0, :32] *= 1e-3
    return x, qs, d, m


# (N, K): N with partial 16- and 8-row tiles, K from one block up
SHAPES = [(45, 96), (200, 576), (33, 1536), (7, 32)]
CALL_SIZES = [1, 2, 3, 7, 16, 64, 300]


def rows_alone_equal_in_calls(fn, x, qtype, qs, d, m, sizes) -> torch.Tensor:
    """fn's output for each row of x alone (scalar build, 1 thread), asserted
    bitwise equal to the same rows in calls of each size in `sizes` on 1 and
    2 threads in every build this CPU runs."""
    threads = torch.get_num_threads()
    rows = x.shape[0]
    try:
        C.set_linear_isa("scalar")
        torch.set_num_threads(1)
        alone = torch.cat([fn(x[i : i + 1], qtype, qs, d, m) for i in range(rows)])
        for name in SUPPORTED:
            C.set_linear_isa(name)
            for t in (1, 2):
                torch.set_num_threads(t)
                for size in sizes:
                    out = torch.cat([fn(x[i : i + size], qtype, qs, d, m) for i in range(0, rows, size)])
                    assert torch.equal(out, alone), f"build={name} threads={t} M={size}"
    finally:
        C.set_linear_isa("auto")
        torch.set_num_threads(threads)
        torch.set_num_threads(threads)
    return alone


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("n,k", SHAPES)
def test_rows_bitwise_invariant(qtype, n, k):
    """Each row alone (scalar build) == the same row in calls of M = 2, 3, 7,
    16, 64, 300 rows, on 1 and 2 threads, in every build this CPU runs."""
    gen = torch.Generator().manual_seed(n * k)
    qs, d, m = random_weight(qtype, n, k, gen)
    x = torch.randn(300, k, generator=gen) * torch.rand(300, 1, generator=gen) * 4
    alone = rows_alone_equal_in_calls(run, x, qtype, qs, d, m, CALL_SIZES[1:])
    check_emulation(alone, x, qtype, qs, d, m)
    check_unquantized(alone, x, qtype, qs, d, m)


@pytest.mark.parametrize("qtype", QTYPES)
def test_accuracy_bounds(build, qtype):
    """Within fp32 rounding of the emulated int8 arithmetic and within the
    int8 rounding bound of x @ W^T: ~0.5% relative for Gaussian x."""
    gen = torch.Generator().manual_seed(11)
    qs, d, m = random_weight(qtype, 300, 1536, gen)
    x = torch.randn(40, 1536, generator=gen)
    out = run(x, qtype, qs, d, m)
    check_emulation(out, x, qtype, qs, d, m)
    assert check_unquantized(out, x, qtype, qs, d, m) < 1e-2


@pytest.mark.parametrize("qtype", QTYPES)
def test_real_gguf_blocks(build, qtype):
    rng = np.random.default_rng(2)
    _, qs, d, m = gguf_packed(qtype, rng.standard_normal((96, 576)).astype(np.float32))
    x = torch.randn(5, 576, generator=torch.Generator().manual_seed(2))
    out = run(x, qtype, qs, d, m)
    check_emulation(out, x, qtype, qs, d, m)
    assert check_unquantized(out, x, qtype, qs, d, m) < 1e-2


@pytest.mark.parametrize("qtype", QTYPES)
def test_zero_outlier_tiny_and_nonfinite_blocks(build, qtype):
    """Zero rows give exact zeros; zero, outlier and subnormal blocks follow
    the emulation; a NaN or inf makes its row NaN and leaves the others
    bitwise as they are alone."""
    gen = torch.Generator().manual_seed(5)
    qs, d, m = random_weight(qtype, 37, 128, gen)
    x = torch.randn(8, 128, generator=gen)
    x[0] = 0.0
    x[1, 32:64] = 0.0
    x[2, 5] = 1e4  # outlier: the rest of block 0 rounds to few steps
    x[3, :32] = torch.arange(-16, 16) + 0.5  # ties: dx = 1 and x / dx = j + 1/2
    x[3, 0] = 127.0
    x[4, 64:96] = 1e-44  # subnormal: dx = 0 (the block adds 0)
    x[5, 96:] = 1e34  # large, products still finite
    x[6, 70] = float("nan")
    x[7, 3] = float("-inf")
    out = run(x, qtype, qs, d, m)
    assert torch.equal(out[0], torch.zeros(37))
    check_emulation(out[:6], x[:6], qtype, qs, d, m)
    assert torch.isnan(out[6:]).all()
    alone = torch.cat([run(x[i : i + 1], qtype, qs, d, m) for i in range(8)])
    assert torch.equal(alone[:6], out[:6]) and torch.isnan(alone[6:]).all()


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("n", [1, 7, 16, 17, 33, 100])
def test_tile_edges_bitwise(qtype, n):
    """N leaving partial register tiles and chunks, M from 1 to beyond the
    row tiles, K = 32 and K with a partial 4-block group: every build equals
    the scalar one."""
    gen = torch.Generator().manual_seed(n)
    for k in (32, 224):
        qs, d, m = random_weight(qtype, n, k, gen)
        x = torch.randn(13, k, generator=gen)
        try:
            C.set_linear_isa("scalar")
            ref = run(x, qtype, qs, d, m)
            for name in SUPPORTED:
                C.set_linear_isa(name)
                for rows in range(1, 14):
                    assert torch.equal(run(x[:rows], qtype, qs, d, m), ref[:rows]), f"{name} M={rows} K={k}"
        finally:
            C.set_linear_isa("auto")
        check_emulation(ref, x, qtype, qs, d, m)


def test_large_m_matches_scalar():
    """A prefill-sized call (1100 rows: several row blocks) equals the scalar build."""
    gen = torch.Generator().manual_seed(9)
    qs, d, m = random_weight("q4_1", 70, 576, gen)
    x = torch.randn(1100, 576, generator=gen)
    try:
        C.set_linear_isa("scalar")
        ref = run(x, "q4_1", qs, d, m)
        C.set_linear_isa("auto")
        assert torch.equal(run(x, "q4_1", qs, d, m), ref)
    finally:
        C.set_linear_isa("auto")
    check_emulation(ref, x, "q4_1", qs, d, m)


def test_float32_default_unchanged_and_bad_activations():
    gen = torch.Generator().manual_seed(4)
    qs, d, m = random_weight("q4_1", 8, 64, gen)
    x = torch.randn(3, 64, generator=gen)
    default, explicit = torch.empty(3, 8), torch.empty(3, 8)
    C.quant_linear(x, "q4_1", qs, d, m, default)
    C.quant_linear(x, "q4_1", qs, d, m, explicit, "float32")
    assert torch.equal(default, explicit)
    assert not torch.equal(run(x, "q4_1", qs, d, m), default)  # int8 is another arithmetic
    with pytest.raises(ValueError, match=r"activations: expected 'float32', 'int8' or 'int8x2', got 'int4'"):
        C.quant_linear(x, "q4_1", qs, d, m, default, "int4")
    with pytest.raises(ValueError, match="x: expected dtype float32, got dtype float64"):  # the same checks as float32
        C.quant_linear(x.double(), "q4_1", qs, d, m, default, "int8")


def test_hiding_vnni_falls_back_to_avx2():
    """PAGED_CPU_HIDE=avx512vnni: an AVX-512 CPU without VNNI runs the avx2
    build, or avxvnni where it has AVX-VNNI (Intel from Sapphire Rapids); amx
    needs AVX512_VNNI too, so it goes as well."""
    if "avx512" not in SUPPORTED:
        pytest.skip("this CPU lacks AVX-512 VNNI")
    code = "from paged import _C_cpu as C; print(C.linear_isa(), *C.supported_linear_isas())"
    env = {**os.environ, "PAGED_CPU_HIDE": "avx512vnni"}
    env.pop("PAGED_CPU_ISA", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    left = ["avxvnni", "avx2", "scalar"] if C.cpu_features()["avxvnni"] else ["avx2", "scalar"]
    assert out.stdout.split() == [left[0], *left]


# -- the whole-stack runner and the Python layers in int8 mode -------------------------

def int8_model(config, weights):
    from paged.backends.cpu.attention import CpuBackend
    from paged.backends.cpu.quant_linear import CpuPackedLinear
    from paged.backends.cpu.worker import prepare_model
    from paged.core.models import build_model
    from test_layer_stack import BLOCK

    backend = CpuBackend(config.num_heads, config.num_kv_heads, config.head_dim, BLOCK, torch.float32, "cpu",
                         sliding_window=config.sliding_window)
    packed = partial(CpuPackedLinear, activations="int8")
    model = build_model(config, weights, torch.float32, "cpu", backend, packed)
    prepare_model(model)  # the CPU worker's layer ops and stack
    return model, backend


def test_layer_stack_int8_bitwise_equal_to_python_layers(monkeypatch):
    """CpuPackedLinear(activations="int8") on every matrix: the stack takes
    the setting, runs steps of any size (no dense branch) and stays bitwise
    equal to the Python layers; int8 hidden states stay close to float32's."""
    from test_layer_stack import check_scenario, make_model, tiny_config, tiny_weights

    config = tiny_config()
    weights = tiny_weights(config)
    model, backend = int8_model(config, weights)
    assert model.layer_stack is not None and model.layer_stack.activations == "int8"
    assert model.layer_stack.handles(1 << 20)
    assert all(layer.qkv.activations == "int8" for layer in model.layers)
    check_scenario(model, backend, monkeypatch, config.vocab_size)

    f32_model, _ = make_model(config, weights)
    assert f32_model.layer_stack.activations == "float32"
    x = torch.randn(9, config.hidden_size, generator=torch.Generator().manual_seed(0))
    f32, i8 = f32_model.layers[0].gate_up.linear(x), model.layers[0].gate_up.linear(x)
    assert not torch.equal(f32, i8) and (i8 - f32).abs().max() <= 0.02 * f32.abs().max()


def test_layer_stack_mixed_or_bad_activations():
    from paged.backends.cpu.layer_stack import LayerStack
    from paged.backends.cpu.quant_linear import CpuPackedLinear, resolve_activations
    from test_layer_stack import packed, tiny_config, tiny_weights

    config = tiny_config()
    model, _ = int8_model(config, tiny_weights(config))
    model.layers[1].down.activations = "float32"
    assert LayerStack.for_model(model) is None  # mixed settings keep the Python path
    with pytest.raises(ValueError, match=r"activations: expected 'float32', 'int8', 'int8x2', 'mixed' or 'mixed-bf16', got 'int4'"):
        CpuPackedLinear(packed(np.random.default_rng(0), 8, 64), activations="int4")
    with pytest.raises(ValueError, match=r"activations: expected 'float32', 'int8', 'int8x2', 'mixed' or 'mixed-bf16', got 'int4'"):
        C.LayerStack(1, 1, 32, 32, 32, 1e-6, 1.0, 0, torch.ones(32), "int4")
    from paged.backends.cpu.quant_linear import bf16_prompt_supported

    assert resolve_activations("auto") == ("mixed-bf16" if bf16_prompt_supported() else "mixed")
    assert resolve_activations("int8") == "int8"
    with pytest.raises(ValueError, match="'auto', 'float32', 'int8', 'int8x2', 'mixed' or 'mixed-bf16', got 'fp8'"):
        resolve_activations("fp8")
