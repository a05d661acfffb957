"""CPU quantized linear (paged._C_cpu.quant_linear / quant_dequantize).

Two paths by the call's row count M (docs/kernels.md): M <= INT16_MAX_ROWS
quantizes x to two-term int16, more rows compute with fp32 x. Oracles: the
dense weight rebuilt in pure torch from the packed arrays by the GGUF layout
(w = d*q + m / d*(q-8) / d*q), the gguf package's own quantize / dequantize
for real blocks, and in float64 x @ W^T: for the int16 path within the error
bound of the two-term activations plus fp32 rounding, and an independent torch
emulation of that quantization times W^T within fp32 rounding; for the fp32
path within fp32 rounding of |x| @ |W|. Bitwise invariance (threads, tilings,
ISAs) holds within each path. These are the activations="float32" paths; the
int8-activation path is tested in test_quant_linear_int8.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from paged import _C_cpu as C

gguf_quants = pytest.importorskip("gguf.quants")
from gguf import GGMLQuantizationType as GGMLType  # noqa: E402

QTYPES = ["q4_0", "q4_1", "q8_0"]
ISAS = C.supported_linear_isas()
INT16_MAX_ROWS = C.LINEAR_INT16_MAX_ROWS
GGML = {"q4_0": GGMLType.Q4_0, "q4_1": GGMLType.Q4_1, "q8_0": GGMLType.Q8_0}


@pytest.fixture(params=ISAS)
def isa(request):
    C.set_linear_isa(request.param)
    yield request.param
    C.set_linear_isa("auto")


def random_weight(qtype: str, n: int, k: int, gen: torch.Generator):
    """Random packed arrays; scales are fp16 values, as GGUF stores them."""
    blocks = k // 32
    scale = lambda: (torch.rand(n, blocks, generator=gen) * 0.2 - 0.1).half().float()  # noqa: E731
    if qtype == "q8_0":
        qs = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen)
    else:
        qs = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    return qs, scale(), scale() if qtype == "q4_1" else None


def dense_parts(qtype: str, qs, d, m) -> tuple[torch.Tensor, torch.Tensor]:
    """The dense [N, K] float64 weight from the layout spec, independent of the
    C++, as its two parts: d * codes, and q4_1's offsets m (zeros otherwise)."""
    n = qs.shape[0]
    if qtype == "q8_0":
        q = qs.to(torch.float64).view(n, -1, 32)
    else:
        b = qs.to(torch.int64).view(n, -1, 16)
        q = torch.cat([b & 0x0F, b >> 4], dim=2).to(torch.float64)  # low nibbles: 0..15, high: 16..31
        if qtype == "q4_0":
            q = q - 8
    scaled = d.double().unsqueeze(2) * q
    offsets = m.double().unsqueeze(2).expand_as(q) if qtype == "q4_1" else torch.zeros_like(q)
    return scaled.reshape(n, -1), offsets.reshape(n, -1)


def dense_oracle(qtype: str, qs, d, m) -> torch.Tensor:
    scaled, offsets = dense_parts(qtype, qs, d, m)
    return scaled + offsets


def run(x, qtype, qs, d, m) -> torch.Tensor:
    out = torch.full((x.shape[0], qs.shape[0]), float("nan"))
    C.quant_linear(x, qtype, qs, d, m, out)
    return out


def int16_codes(v: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """round_half_even(v / scale) in float32, clamped to +-32767; 0 where scale is 0."""
    q = torch.where(scale > 0, v / scale, torch.zeros_like(v))
    return q.round().clamp(-32767, 32767)


def quantize_like_kernel(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The documented two-term int16 quantization of x, in torch: per 32-block
    s = max|x| / 32767, hi = round(x / s), residual x - s*hi, s_lo = s / 65536,
    lo = round(residual / s_lo) (codes clamped to +-32767, divisions in
    float32). Returns, in float64, the value the kernel multiplies,
    s*hi + s_lo*lo [M, K], and the per-element quantization bound [M, K]:
    s_lo/2, or s_lo where a tie's lo code was clamped."""
    blocks = x.float().view(x.shape[0], -1, 32)
    s = blocks.abs().amax(dim=2, keepdim=True) / 32767.0
    hi = int16_codes(blocks, s)
    residual = blocks.double() - s.double() * hi.double()  # exact in float64 (s * hi has 40 bits)
    # The kernel takes the residual from one fp32 fma: right only if it is an fp32 value.
    assert torch.equal(residual.float().double(), residual)
    s_lo = s * 2.0**-16
    lo = int16_codes(residual.float(), s_lo)
    value = s.double() * hi.double() + s_lo.double() * lo.double()
    bound = torch.where(lo.abs() == 32767, s_lo, s_lo / 2).double().expand_as(value)
    return value.reshape(x.shape), bound.reshape(x.shape)


def fp32_rounding(x, qtype, extra_ops: int) -> float:
    """Relative fp32 rounding budget per output: K/32 accumulating fmas, a
    3-level hsum, q4_1's block sums (3 adds + hsum) and offset fmas, plus
    `extra_ops` roundings per block product t: at most K/32 + 9 + extra_ops
    roundings of 2^-24."""
    return (x.shape[1] // 32 + 9 + extra_ops) * 2.0**-24


def check_close(out, x, qtype, qs, d, m, outliers: bool = False):
    """out of one call against float64, with the bound of the path that call took."""
    if x.shape[0] <= INT16_MAX_ROWS:
        check_close_int16(out, x, qtype, qs, d, m, outliers)
    else:
        check_close_fp32(out, x, qtype, qs, d, m)


def check_close_fp32(out, x, qtype, qs, d, m):
    """|out - x @ W^T| within fp32 rounding of |x| @ |W| (t = 1 multiply +
    3 fmas per lane): ~4e-6 relative at K = 1536, tighter than 1e-5."""
    scaled, offsets = dense_parts(qtype, qs, d, m)
    xd = x.double()
    size = xd.abs() @ (scaled.abs() + offsets.abs()).T
    err = (out.double() - xd @ (scaled + offsets).T).abs()
    tol = fp32_rounding(x, qtype, extra_ops=4)
    assert tol <= 1e-5
    assert torch.all(err <= tol * size + 1e-30), f"max excess {(err - tol * size).max().item()}"


def check_close_int16(out, x, qtype, qs, d, m, outliers: bool = False):
    """Two checks: (1) |out - x @ W^T| within the quantization bound
    sum_k bound_k * |d q_k| (~2^-32 of the block maxima) plus fp32 rounding;
    (2) out equals the float64 product of the emulated two-term quantization
    of x with the d*q part (exact x with q4_1's offsets) to fp32 rounding."""
    scaled, offsets = dense_parts(qtype, qs, d, m)
    xd = x.double()
    xq, bound = quantize_like_kernel(x)
    # t per lane: one multiply and an fma with the lo term.
    tol = fp32_rounding(x, qtype, extra_ops=0)
    rounding = bound @ scaled.abs().T
    size = xd.abs() @ (scaled.abs() + offsets.abs()).T
    err = (out.double() - xd @ (scaled + offsets).T).abs()
    assert torch.all(err <= rounding + tol * size + 1e-30), f"max excess {(err - rounding - tol * size).max().item()}"
    if not outliers:  # the quantization bound is not vacuous: ~1e-9 of the terms' size
        assert torch.all(rounding <= 1e-8 * (xd.abs() @ scaled.abs().T) + 1e-30)

    emulated = xq @ scaled.T + xd @ offsets.T
    size = xq.abs() @ scaled.abs().T + xd.abs() @ offsets.abs().T
    err = (out.double() - emulated).abs()
    assert torch.all(err <= tol * size + 1e-30), f"max excess {(err - tol * size).max().item()}"


def gguf_packed(qtype: str, data: np.ndarray):
    """Quantize with gguf and split its blocks into (qs, d, m) tensors."""
    raw = gguf_quants.quantize(data, GGML[qtype])
    n = data.shape[0]
    header = 4 if qtype == "q4_1" else 2
    blocks = raw.reshape(n, data.shape[1] // 32, -1)
    d = blocks[:, :, 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = blocks[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float32) if qtype == "q4_1" else None
    qs = blocks[:, :, header:].reshape(n, -1).copy()
    if qtype == "q8_0":
        qs = qs.view(np.int8)
    tensor = lambda a: None if a is None else torch.from_numpy(np.ascontiguousarray(a))  # noqa: E731
    return raw, tensor(qs), tensor(d), tensor(m)


@pytest.mark.parametrize("qtype", QTYPES)
def test_dequantize_matches_gguf_exactly(qtype):
    rng = np.random.default_rng(0)
    data = (rng.standard_normal((9, 576)) * rng.uniform(0.01, 3, (9, 1))).astype(np.float32)
    raw, qs, d, m = gguf_packed(qtype, data)
    out = torch.empty(9, 576)
    C.quant_dequantize(qtype, qs, d, m, out)
    expected = torch.from_numpy(gguf_quants.dequantize(raw, GGML[qtype]).astype(np.float32))
    assert torch.equal(out, expected)
    assert torch.equal(out.double(), dense_oracle(qtype, qs, d, m))


# Every N, K and M of the brief at least once, without the full cross product.
SHAPES = [(1, 32, 1), (7, 576, 3), (960, 576, 16), (3072, 576, 1), (7, 1536, 70), (960, 1536, 1),
          (1, 1536, 16), (3072, 32, 70)]


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("n,k,m_rows", SHAPES)
def test_matches_float64_oracle(isa, qtype, n, k, m_rows):
    if isa != ISAS[0] and n * k * m_rows > 1 << 22:
        pytest.skip("large shapes run on the best ISA only; other ISAs are checked bitwise against it")
    gen = torch.Generator().manual_seed(n * 7 + k + m_rows)
    qs, d, m = random_weight(qtype, n, k, gen)
    x = torch.randn(m_rows, k, generator=gen)
    check_close(run(x, qtype, qs, d, m), x, qtype, qs, d, m)


@pytest.mark.parametrize("qtype", QTYPES)
def test_real_gguf_blocks(qtype):
    rng = np.random.default_rng(1)
    data = rng.standard_normal((96, 1536)).astype(np.float32)
    raw, qs, d, m = gguf_packed(qtype, data)
    w = torch.from_numpy(gguf_quants.dequantize(raw, GGML[qtype]).astype(np.float64))
    assert torch.equal(dense_oracle(qtype, qs, d, m), w)
    x = torch.randn(5, 1536, generator=torch.Generator().manual_seed(1))
    check_close(run(x, qtype, qs, d, m), x, qtype, qs, d, m)


@pytest.mark.parametrize("qtype", QTYPES)
def test_batch_thread_and_isa_invariance(qtype):
    """Within a path, a row's bits do not depend on the call: fp32 path (calls
    of > INT16_MAX_ROWS rows) the same in one call of 70, in calls of 16 and in
    calls of 3; int16 path the same alone and in pairs; both on 1 or 2 threads
    and on every ISA. Across paths: each meets its own float64 bound, and they
    differ bitwise somewhere (the call's size did choose the path)."""
    assert INT16_MAX_ROWS == 2  # docs/kernels.md states it
    gen = torch.Generator().manual_seed(3)
    qs, d, m = random_weight(qtype, 960, 576, gen)
    x = torch.randn(70, 576, generator=gen)
    calls = lambda size, rows: torch.cat([run(x[i : i + size], qtype, qs, d, m) for i in range(0, rows, size)])  # noqa: E731
    threads = torch.get_num_threads()
    fp32, int16 = [], []
    try:
        for name in ISAS:
            C.set_linear_isa(name)
            for t in (1, 2):
                torch.set_num_threads(t)
                fp32.append((run(x, qtype, qs, d, m), 70))
                fp32.append((torch.cat([calls(16, 64), run(x[64:], qtype, qs, d, m)]), 70))
                fp32.append((calls(3, 69), 69))
                int16.append((calls(1, 8), 8))
                int16.append((calls(2, 8), 8))
    finally:
        C.set_linear_isa("auto")
        torch.set_num_threads(threads)
    for results in (fp32, int16):
        first, _ = results[0]
        for r, rows in results[1:]:
            assert torch.equal(r, first[:rows])
    check_close_fp32(fp32[0][0], x, qtype, qs, d, m)
    check_close_int16(int16[0][0], x[:8], qtype, qs, d, m)
    assert not torch.equal(int16[0][0], fp32[0][0][:8])


@pytest.mark.parametrize("qtype", QTYPES)
def test_zero_outlier_and_nonfinite_blocks(isa, qtype):
    """All-zero blocks (s = 0), blocks whose values span many magnitudes
    (small values round to few int16 steps; still within the bound), exact
    +-32767 multiples, and NaN / inf rows: those rows come out non-finite,
    the other rows are untouched; in one call (fp32 path) and alone (int16)."""
    gen = torch.Generator().manual_seed(5)
    qs, d, m = random_weight(qtype, 13, 128, gen)
    x = torch.randn(6, 128, generator=gen)
    x[0] = 0.0
    x[1, 32:64] = 0.0
    x[2, 5] = 1e4
    x[3, :32] = torch.arange(-16, 16) * 32767.0 / 16
    x[4, 70] = float("nan")
    x[5, 3] = float("inf")
    out = run(x, qtype, qs, d, m)  # fp32 path
    check_close_fp32(out[:4], x[:4], qtype, qs, d, m)
    assert torch.equal(out[:4], run(x[:4], qtype, qs, d, m))
    assert torch.isnan(out[4]).all() and not torch.isfinite(out[5]).any()
    alone = torch.cat([run(x[i : i + 1], qtype, qs, d, m) for i in range(6)])  # int16 path
    check_close_int16(alone[:4], x[:4], qtype, qs, d, m, outliers=True)
    assert torch.isnan(alone[4]).all() and not torch.isfinite(alone[5]).any()


@pytest.mark.parametrize("qtype", QTYPES)
def test_outlier_keeps_small_values_exact(isa, qtype):
    """A block with an outlier 1000x its other values (the outlier's weight
    zero): one int16 term would leave those values ~30 steps (3% error);
    with the second term (rows alone: int16 path) out meets x @ W^T in float64 within fp32 rounding of
    the small terms plus the two-term bound (~2^-32 of the outlier per
    element). Also ties (x = s * (j + 1/2)), whose lo code is clamped, stay
    within the documented bound. The same rows in one call (fp32 path) meet
    fp32 rounding alone."""
    gen = torch.Generator().manual_seed(6)
    k = 128
    qs, d, m = random_weight(qtype, 11, k, gen)
    outlier = 32 + 3  # block 1; zero the weights of elements 35 and 51 (one byte for 4-bit types)
    if qtype == "q8_0":
        qs[:, outlier] = 0
    else:
        qs[:, 16 + 3] = 0x88 if qtype == "q4_0" else 0x00
        if qtype == "q4_1":
            m[:, 1] = 0.0  # q4_1's offsets multiply the exact block sums, which the outlier would dominate
    x = torch.randn(3, k, generator=gen) * 1e-2
    x[:, outlier] = 10.0
    x[2, :32] = torch.arange(32) + 0.5  # ties: hi rounds half to even, the residual is s/2
    x[2, 0] = 32767.0  # so s = 1
    w = dense_oracle(qtype, qs, d, m)
    assert torch.all(w[:, outlier] == 0)
    size = x.double().abs() @ w.abs().T
    _, bound = quantize_like_kernel(x)
    int16 = torch.cat([run(x[i : i + 1], qtype, qs, d, m) for i in range(3)])
    fp32 = run(x, qtype, qs, d, m)
    check_close_int16(int16, x, qtype, qs, d, m, outliers=True)
    check_close_fp32(fp32, x, qtype, qs, d, m)
    for out, quantization, extra_ops in ((int16, bound @ w.abs().T, 0), (fp32, 0.0, 4)):
        err = (out.double() - x.double() @ w.T).abs()
        allowed = fp32_rounding(x, qtype, extra_ops) * size + quantization
        assert torch.all(err <= allowed), f"max excess {(err - allowed).max().item()}"


def test_argument_errors():
    gen = torch.Generator().manual_seed(4)
    qs, d, m = random_weight("q4_1", 8, 64, gen)
    x, out = torch.randn(2, 64), torch.empty(2, 8)
    cases = [
        ((x, "q5_k", qs, d, m, out), r"qtype: expected 'q4_0', 'q4_1', 'q8_0', 'q8_0.s5', 'q8_0.nl4', 's16' or packed s16 codes \('s16.u2' \.\. 's16.u6', 's16.s2' \.\. 's16.s6', 's16.u5b', 's16.s5b'\), got 'q5_k'"),
        ((x.double(), "q4_1", qs, d, m, out), "x: expected dtype float32, got dtype float64"),
        ((torch.randn(2, 32), "q4_1", qs, d, m, out), r"x: expected shape \[2, 64\], got shape \[2, 32\] \(x is \[M, K\]"),
        ((x.t().contiguous().t(), "q4_1", qs, d, m, out), r"x: expected a contiguous tensor \(stride 1 in dim 1\), got shape \[2, 64\] with stride 2"),
        ((x, "q4_1", qs.to(torch.int8), d, m, out), "qs: expected dtype uint8, got dtype int8"),
        ((x, "q4_1", qs[:, :8].contiguous(), d, m, torch.empty(2, 8)), r"qs: expected N >= 1 rows and K a positive multiple of 32 .*, got shape \[8, 8\], K = 16"),
        ((x, "q4_1", qs, d[:, :1].contiguous(), m, out), r"d: expected shape \[8, 2\], got shape \[8, 1\] \(one scale per 32 weights of each row\)"),
        ((x, "q4_1", qs, d.half(), m, out), "d: expected dtype float32, got dtype float16"),
        ((x, "q4_1", qs, d, None, out), r"m: expected a tensor for qtype 'q4_1' \(w = d \* q \+ m\), got None"),
        ((x, "q4_0", qs, d, m, out), r"m: expected None or empty for qtype 'q4_0' .*, got a tensor of 16 elements"),
        ((x, "q8_0", qs, d, None, out), "qs: expected dtype int8, got dtype uint8"),
        ((x, "q4_1", qs, d, m, torch.empty(2, 9)), r"out: expected shape \[2, 8\], got shape \[2, 9\]"),
        ((torch.empty(0, 64), "q4_1", qs, d, m, torch.empty(0, 8)), r"x: expected at least one row, got shape \[0, 64\]"),
        ((x.view(2, 1, 64), "q4_1", qs, d, m, out), r"x: expected a 2-D tensor, got shape \[2, 1, 64\]"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            C.quant_linear(*args)
    with pytest.raises(ValueError, match=r"out: expected shape \[8, 64\], got shape \[8, 32\]"):
        C.quant_dequantize("q4_1", qs, d, m, torch.empty(8, 32))
    with pytest.raises(ValueError, match="not-an-isa"):
        C.set_linear_isa("not-an-isa")
    assert C.linear_isa() in ISAS
    # q4_0 accepts an empty m as "no offset".
    C.quant_linear(x, "q4_0", qs, d, torch.empty(0), out)


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("n", [1, 2, 4, 7, 961])
def test_tile_edges_bitwise(qtype, n):
    """Every M (int16 path 1..2, fp32 direct tiles 3..4, fp32 panels beyond)
    and N that leaves partial tiles and panels gives, row for row, the bits of
    the scalar build of the same path: for the fp32 path the scalar build run
    on all 70 rows at once, for the int16 path on the same rows; the scalar
    results meet their float64 oracles."""
    gen = torch.Generator().manual_seed(n)
    k = 96  # three blocks: enough for the block loop, small enough to stay quick
    qs, d, m = random_weight(qtype, n, k, gen)
    x = torch.randn(70, k, generator=gen)
    try:
        C.set_linear_isa("scalar")
        ref = run(x, qtype, qs, d, m)
        check_close(ref, x, qtype, qs, d, m)
        ref_int16 = {rows: run(x[:rows], qtype, qs, d, m) for rows in range(1, INT16_MAX_ROWS + 1)}
        for rows, out in ref_int16.items():
            check_close(out, x[:rows], qtype, qs, d, m)
        for name in ISAS:
            C.set_linear_isa(name)
            for rows in (1, 2, 3, 4, 5, 6, 7, 9, 17, 70):
                expected = ref_int16[rows] if rows <= INT16_MAX_ROWS else ref[:rows]
                assert torch.equal(run(x[:rows], qtype, qs, d, m), expected), f"isa={name} M={rows}"
    finally:
        C.set_linear_isa("auto")
