"""Fused elementwise ops of paged._C_cpu (csrc_cpu/ops) against float64 torch
references: values (float32 and bfloat16, odd shapes, both ISA builds),
in-place semantics, bitwise row invariance across batch sizes, bad input."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from paged.core.models.layers import rope_inv_freq

C = pytest.importorskip("paged._C_cpu", reason="the CPU extension is not built")

DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1e-2, atol=1e-2)}


def _available_isas() -> list[str]:
    isas = ["scalar"]
    try:
        C.set_fused_ops_isa("avx2")
        isas.append("avx2")
    except ValueError:
        pass
    finally:
        C.set_fused_ops_isa("auto")
    return isas


@pytest.fixture(params=_available_isas())
def isa(request):
    C.set_fused_ops_isa(request.param)
    yield request.param
    C.set_fused_ops_isa("auto")


def rand(*shape, dtype=torch.float32, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)


def ref_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x64 = x.double()
    return x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * w.double()


def close(actual, expected, dtype):
    torch.testing.assert_close(actual.double(), expected.double(), **TOL[dtype])


# --- values ----------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,n", [(1, 576), (3, 17), (5, 1), (33, 1000)])
def test_rms_norm(isa, dtype, t, n):
    x, w = rand(t, n, dtype=dtype, scale=3.0), rand(n, dtype=dtype, seed=1)
    out = torch.empty_like(x)
    C.rms_norm(out, x, w, 1e-6)
    close(out, ref_rms_norm(x, w, 1e-6), dtype)
    C.rms_norm(x, x, w, 1e-6)  # in place (out is x)
    assert torch.equal(x, out)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,n", [(1, 576), (4, 23), (40, 130)])
def test_fused_add_rms_norm_in_place(isa, dtype, t, n):
    x, res, w = rand(t, n, dtype=dtype), rand(t, n, dtype=dtype, seed=1), rand(n, dtype=dtype, seed=2)
    expected_res = x + res  # torch's add rounds once from float, like the kernel
    expected_x = ref_rms_norm(expected_res, w, 1e-5)
    C.fused_add_rms_norm(x, res, w, 1e-5)
    assert torch.equal(res, expected_res)
    close(x, expected_x, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,inter", [(1, 1536), (3, 7), (9, 100)])
def test_silu_and_mul(isa, dtype, t, inter):
    gu = rand(t, 2 * inter, dtype=dtype, scale=4.0)
    if inter >= 5:  # exp's clamped range (exp(-g) is clamped at g = -64 and 87) and zero
        gu[0, :5] = torch.tensor([0.0, -100.0, 100.0, -30.0, -70.0]).to(dtype)
    out = torch.empty(t, inter, dtype=dtype)
    C.silu_and_mul(out, gu)
    g, u = gu.double().chunk(2, dim=-1)
    close(out, F.silu(g) * u, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,inter", [(1, 640), (3, 7), (9, 100)])
def test_gelu_tanh_and_mul(isa, dtype, t, inter):
    gu = rand(t, 2 * inter, dtype=dtype, scale=4.0)
    if inter >= 5:  # where exp's clamp bites (2y beyond -64 / 87) and zero
        gu[0, :5] = torch.tensor([0.0, -100.0, 100.0, -5.0, -9.0]).to(dtype)
    out = torch.empty(t, inter, dtype=dtype)
    C.gelu_tanh_and_mul(out, gu)
    g, u = gu.double().chunk(2, dim=-1)
    close(out, F.gelu(g, approximate="tanh") * u, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,h,hkv,d", [(1, 4, 2, 32), (5, 3, 1, 16), (17, 2, 2, 256)])
def test_qk_rms_norm_in_place(isa, dtype, t, h, hkv, d):
    qkv = rand(t, (h + 2 * hkv) * d, dtype=dtype, scale=3.0)
    qw, kw = rand(d, dtype=dtype, seed=1), rand(d, dtype=dtype, seed=2)
    want = qkv.double().clone()
    q = want[:, :h * d].view(t, h, d)
    k = want[:, h * d:(h + hkv) * d].view(t, hkv, d)
    want[:, :h * d] = ref_rms_norm(q, qw, 1e-6).reshape(t, h * d)
    want[:, h * d:(h + hkv) * d] = ref_rms_norm(k, kw, 1e-6).reshape(t, hkv * d)
    v_before = qkv[:, (h + hkv) * d:].clone()
    C.qk_rms_norm(qkv, qw, kw, h, hkv, d, 1e-6)
    close(qkv, want, dtype)
    assert torch.equal(qkv[:, (h + hkv) * d:], v_before)


@pytest.mark.parametrize("dtype", DTYPES)
def test_partial_rotary_rotates_the_leading_dims(isa, dtype):
    """A table narrower than the head (Phi-4-mini's 3/4): each head's first
    R dims take the half rotation over R, the rest pass unchanged."""
    t, h, hkv, d, r = 5, 4, 2, 16, 12
    inv_freq = rope_inv_freq(r, 10000.0, None)
    cache = cos_sin_cache(inv_freq, 64)
    positions = torch.tensor([0, 1, 7, 63, 30])
    qkv = rand(t, (h + 2 * hkv) * d, dtype=dtype)
    heads = qkv.double().clone()[:, :(h + hkv) * d].view(t, h + hkv, d)
    want = qkv.double().clone()
    rotated = ref_rope(heads[..., :r].reshape(t, -1).contiguous(), positions, inv_freq, h + hkv, 0, r)
    want[:, :(h + hkv) * d].view(t, h + hkv, d)[..., :r] = rotated.view(t, h + hkv, r)
    C.rotary_embedding(positions, qkv, cache, h, hkv, d)
    close(qkv, want, dtype)
    assert torch.equal(qkv.view(t, -1, d)[:, :h + hkv, r:].double(), heads[..., r:])


def ref_rope(qkv, positions, inv_freq, h, hkv, d):
    """float64 half rotation of the q and k heads; v untouched."""
    t = qkv.shape[0]
    out = qkv.double().clone()
    ang = positions.double()[:, None] * inv_freq.double()[None, :]  # [T, D/2]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    heads = out[:, :(h + hkv) * d].view(t, h + hkv, d)
    x1, x2 = heads[..., :d // 2].clone(), heads[..., d // 2:].clone()
    heads[..., :d // 2] = x1 * cos - x2 * sin
    heads[..., d // 2:] = x2 * cos + x1 * sin
    return out


def cos_sin_cache(inv_freq, max_pos):
    ang = torch.outer(torch.arange(max_pos, dtype=torch.float64), inv_freq.double())
    return torch.cat((ang.cos(), ang.sin()), dim=-1).float()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,h,hkv,d", [(1, 9, 3, 64), (5, 4, 4, 6), (17, 2, 1, 128)])
def test_rotary_embedding(isa, dtype, t, h, hkv, d):
    inv_freq = rope_inv_freq(d, 10000.0, None)
    cache = cos_sin_cache(inv_freq, 4096)
    positions = torch.randint(0, 4096, (t,), generator=torch.Generator().manual_seed(3))
    qkv = rand(t, (h + 2 * hkv) * d, dtype=dtype)
    v_before = qkv[:, (h + hkv) * d:].clone()
    expected = ref_rope(qkv, positions, inv_freq, h, hkv, d)
    C.rotary_embedding(positions, qkv, cache, h, hkv, d)
    close(qkv, expected, dtype)
    assert torch.equal(qkv[:, (h + hkv) * d:], v_before)


def test_split_qkv():
    t, h, hkv, d = 6, 9, 3, 64
    qkv = rand(t, (h + 2 * hkv) * d)
    q, k, v = torch.empty(t, h, d), torch.empty(t, hkv, d), torch.empty(t, hkv, d)
    C.split_qkv(qkv, q, k, v)
    assert torch.equal(q.view(t, -1), qkv[:, :h * d])
    assert torch.equal(k.view(t, -1), qkv[:, h * d:(h + hkv) * d])
    assert torch.equal(v.view(t, -1), qkv[:, (h + hkv) * d:])


# --- batch invariance --------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_do_not_depend_on_batch(isa, dtype):
    """Large T runs multi-threaded, T=1 on the calling thread: each row must
    come out bitwise the same either way."""
    t, n, inter, h, hkv, d = 200, 576, 1536, 9, 3, 64
    x, res, w = rand(t, n, dtype=dtype), rand(t, n, dtype=dtype, seed=1), rand(n, dtype=dtype, seed=2)
    gu = rand(t, 2 * inter, dtype=dtype, seed=3)
    qkv = rand(t, (h + 2 * hkv) * d, dtype=dtype, seed=4)
    cache = cos_sin_cache(rope_inv_freq(d, 10000.0, None), 1024)
    pos = torch.randint(0, 1024, (t,), generator=torch.Generator().manual_seed(5))

    def run(rows):
        xs, rs, g, q = x[rows].clone(), res[rows].clone(), gu[rows], qkv[rows].clone()
        normed = torch.empty_like(xs)
        C.rms_norm(normed, xs, w, 1e-6)
        C.fused_add_rms_norm(xs, rs, w, 1e-6)
        act = torch.empty(len(g), inter, dtype=dtype)
        C.silu_and_mul(act, g.contiguous())
        C.rotary_embedding(pos[rows].contiguous(), q, cache, h, hkv, d)
        return normed, xs, rs, act, q

    batched = run(slice(0, t))
    for i in (0, 77, t - 1):
        for whole, alone in zip(batched, run(slice(i, i + 1))):
            assert torch.equal(whole[i:i + 1], alone)


# --- bad input -----------------------------------------------------------------

def test_bad_arguments_raise_naming_the_value():
    x, w = torch.randn(2, 8), torch.randn(8)
    with pytest.raises(ValueError, match=r"weight: expected shape \[8\] \(one per element of a x row\), got shape \[7\]"):
        C.rms_norm(torch.empty_like(x), x, torch.randn(7), 1e-6)
    with pytest.raises(ValueError, match=r"x: expected dtype float32 or bfloat16 \(the fused ops. dtypes\), got dtype float16"):
        C.rms_norm(x.half(), x.half(), w.half(), 1e-6)
    with pytest.raises(ValueError, match=r"weight: expected the dtype of x \(float32\), got dtype bfloat16"):
        C.fused_add_rms_norm(x, torch.randn(2, 8), w.bfloat16(), 1e-6)
    with pytest.raises(ValueError, match=r"eps: expected in \[0, 1\], got -1"):
        C.rms_norm(torch.empty_like(x), x, w, -1.0)
    with pytest.raises(ValueError, match="contiguous"):
        C.rms_norm(torch.empty(8, 2).t(), x, w, 1e-6)
    with pytest.raises(ValueError, match=r"residual: expected a tensor other than x, got x itself \(both are updated\)"):
        C.fused_add_rms_norm(x, x, w, 1e-6)
    with pytest.raises(ValueError, match=r"out: expected shape \[2, 4\] \(for gate_up \[2, 8\]\), got shape \[2, 3\]"):
        C.silu_and_mul(torch.empty(2, 3), x)
    cache = torch.randn(16, 8)
    qkv = torch.randn(2, 3 * 8)
    with pytest.raises(ValueError, match="head_dim: expected an even number, got 7"):
        C.rotary_embedding(torch.zeros(2, dtype=torch.int64), torch.randn(2, 3 * 7), cache, 1, 1, 7)
    with pytest.raises(ValueError, match=r"qkv: expected dim 1 = 32 \(\(num_heads \+ 2 \* num_kv_heads\) \* head_dim\), got shape \[2, 24\]"):
        C.rotary_embedding(torch.zeros(2, dtype=torch.int64), qkv, cache, 2, 1, 8)
    with pytest.raises(ValueError, match="positions: expected dtype int64, got dtype int32"):
        C.rotary_embedding(torch.zeros(2, dtype=torch.int32), qkv, cache, 1, 1, 8)
    with pytest.raises(IndexError, match=r"positions\[1\]: expected a position in \[0, 16\) \(the rotary table.s size\), got 16$"):
        C.rotary_embedding(torch.tensor([0, 16]), qkv, cache, 1, 1, 8)
    with pytest.raises(ValueError, match=r"cos_sin_cache: expected shape \[max_pos, R\], R even in \[2, head_dim = 8\], got shape \[16, 10\]"):
        C.rotary_embedding(torch.zeros(2, dtype=torch.int64), qkv, torch.randn(16, 10), 1, 1, 8)
    with pytest.raises(ValueError, match=r"k_weight: expected the dtype of qkv \(float32\), got dtype bfloat16"):
        C.qk_rms_norm(qkv, torch.ones(8), torch.ones(8, dtype=torch.bfloat16), 1, 1, 8, 1e-6)
    with pytest.raises(ValueError, match=r"q_weight: expected shape \[8\]"):
        C.qk_rms_norm(qkv, torch.ones(7), torch.ones(8), 1, 1, 8, 1e-6)
    with pytest.raises(ValueError, match=r"out: expected shape \[2, 4\] \(for gate_up \[2, 8\]\), got shape \[2, 3\]"):
        C.gelu_tanh_and_mul(torch.empty(2, 3), x)
    with pytest.raises(ValueError, match=r"fused ops ISA: expected one of auto, .*\(the ISAs available on this CPU\), got .avx9000.$"):
        C.set_fused_ops_isa("avx9000")


# --- the model's layer ops: fused CPU path vs the torch path -------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_layer_ops_match_torch_ops(dtype):
    """CpuFusedLayerOps (capsule plumbing, float32 cos/sin table) against
    TorchLayerOps (torch ops over RotaryTable's cos/sin) on one layer's worth."""
    from paged.backends.cpu.layer_ops import fused_layer_ops
    from paged.core.models.layers import RotaryTable, TorchLayerOps

    fused, plain = fused_layer_ops(dtype), TorchLayerOps()
    assert fused.name == "cpu-fused"
    t, n, inter, h, hkv, d = 5, 96, 40, 4, 2, 16
    rope = RotaryTable(d, 512, 10000.0, {"rope_type": "llama3", "factor": 8.0,
                                         "original_max_position_embeddings": 64}, dtype, torch.device("cpu"))
    positions = torch.tensor([0, 3, 100, 511, 7])
    x, res, w = rand(t, n, dtype=dtype), rand(t, n, dtype=dtype, seed=1), rand(n, dtype=dtype, seed=2)
    qkv, gu = rand(t, (h + 2 * hkv) * d, dtype=dtype, seed=3), rand(t, 2 * inter, dtype=dtype, seed=4)

    close(fused.rms_norm(x, w, 1e-6), plain.rms_norm(x, w, 1e-6), dtype)
    want_x, want_res = plain.add_rms_norm(x, res, w, 1e-6)
    got_x, got_res = fused.add_rms_norm(x.clone(), res.clone(), w, 1e-6)
    assert torch.equal(got_res, want_res)
    close(got_x, want_x, dtype)
    close(fused.silu_and_mul(gu), plain.silu_and_mul(gu), dtype)
    close(fused.gelu_tanh_and_mul(gu), plain.gelu_tanh_and_mul(gu), dtype)
    qn, kn = rand(d, dtype=dtype, seed=5), rand(d, dtype=dtype, seed=6)
    close(fused.qk_norm(qkv.clone(), qn, kn, h, hkv, d, 1e-6), plain.qk_norm(qkv.clone(), qn, kn, h, hkv, d, 1e-6),
          dtype)
    partial = RotaryTable(d, 512, 10000.0, None, dtype, torch.device("cpu"), rotary_dim=12)
    want = plain.rope_split_qkv(qkv, partial, plain.rope_inputs(partial, positions), h, hkv, d)
    got = fused.rope_split_qkv(qkv.clone(), partial, fused.rope_inputs(partial, positions), h, hkv, d)
    for g, e in zip(got, want):
        close(g, e, dtype)
    want = plain.rope_split_qkv(qkv, rope, plain.rope_inputs(rope, positions), h, hkv, d)
    got = fused.rope_split_qkv(qkv.clone(), rope, fused.rope_inputs(rope, positions), h, hkv, d)
    for g, e in zip(got, want):
        assert g.shape == e.shape and g.is_contiguous()
        close(g, e, dtype)


def test_argmax_rows_is_torch_argmax(isa):
    """The sampler's argmax (CpuWorker.argmax): first index of the maximum,
    ties, +-inf and NaN rows (the first NaN wins), lane-count tails; the
    conformance suite's cases, in each build."""
    from paged.core.conformance.platform_checks import argmax_cases

    for logits in argmax_cases(seed=1):
        out = torch.full((logits.shape[0],), -1, dtype=torch.int64)
        C.argmax_rows(logits, out)
        assert torch.equal(out, logits.argmax(dim=-1)), (isa, tuple(logits.shape))
    # a row's answer does not depend on its batch (each row is one thread's)
    rows = rand(33, 4099, seed=5)
    alone = torch.empty(1, dtype=torch.int64)
    batched = torch.empty(33, dtype=torch.int64)
    C.argmax_rows(rows, batched)
    for r in range(33):
        C.argmax_rows(rows[r:r + 1], alone)
        assert alone.item() == batched[r].item()


def test_argmax_rows_bad_arguments():
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="logits: expected dtype float32, got dtype bfloat16"):
        C.argmax_rows(x.bfloat16(), torch.empty(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="out: expected dtype int64, got dtype int32"):
        C.argmax_rows(x, torch.empty(2, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"out: expected shape \[2\]"):
        C.argmax_rows(x, torch.empty(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="logits: expected"):  # rows of no values
        C.argmax_rows(torch.empty(2, 0), torch.empty(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="contiguous"):
        C.argmax_rows(torch.randn(8, 2).t(), torch.empty(2, dtype=torch.int64))


def test_cpu_worker_argmax_falls_back_to_torch_for_other_tensors():
    from paged.backends.cpu.worker import CpuWorker
    from paged.platforms.cpu import CpuPlatform

    p = CpuWorker(CpuPlatform())
    for t in (torch.randn(3, 40).t(), torch.randn(4, 64, dtype=torch.float64), torch.randn(40), torch.empty(0, 5)):
        assert torch.equal(p.argmax(t), t.argmax(dim=-1))


# --- mixture-of-experts routing ----------------------------------------------

def _route(x, router, k, scoring, normalize):
    weights = torch.full((x.shape[0], k), -1.0)
    ids = torch.full((x.shape[0], k), -1, dtype=torch.int64)
    C.moe_route(x, router, k, scoring, normalize, weights, ids)
    return weights, ids


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("hidden,experts,k", [(64, 8, 2), (100, 60, 4), (257, 128, 8)])
def test_moe_route_matches_float64_routing(isa, scoring, normalize, hidden, experts, k):
    """moe_route against the routing of core/models/moe.py's route done in
    float64: the same experts in the same order, the weights to float32
    rounding; a row alone gives its batched bits."""
    x, router = rand(19, hidden, seed=1), rand(experts, hidden, seed=2, scale=0.3)
    weights, ids = _route(x, router, k, scoring, normalize)
    logits = x.double() @ router.double().T
    scores = torch.softmax(logits, -1) if scoring == "softmax" else torch.sigmoid(logits)
    want_w, want_ids = torch.topk(scores, k, dim=-1)
    if normalize:
        want_w = want_w / want_w.sum(-1, keepdim=True)
    assert torch.equal(ids, want_ids), isa
    torch.testing.assert_close(weights.double(), want_w, rtol=2e-6, atol=1e-7)
    for r in (0, 7, 18):
        w1, i1 = _route(x[r:r + 1], router, k, scoring, normalize)
        assert torch.equal(w1[0], weights[r]) and torch.equal(i1[0], ids[r])


def test_moe_route_breaks_ties_to_the_lower_id(isa):
    x, router = rand(5, 300, seed=3), rand(32, 300, seed=4)
    router[9] = router[4]  # experts 4 and 9 tie on every row
    for scoring in ("softmax", "sigmoid"):
        weights, ids = _route(x, router, 32, scoring, True)
        for row in ids.tolist():
            assert sorted(row) == list(range(32)) and row.index(4) == row.index(9) - 1, (isa, scoring)
        assert torch.equal(weights, weights.sort(dim=-1, descending=True).values)


def test_moe_route_bad_arguments_name_the_value():
    x, router = torch.randn(2, 16), torch.randn(4, 16)
    w, i = torch.empty(2, 2), torch.empty(2, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"^top_k: expected in \[1, experts = 4\], got 5$"):
        C.moe_route(x, router, 5, "softmax", True, torch.empty(2, 5), torch.empty(2, 5, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"^scoring: expected 'softmax' or 'sigmoid', got 'relu'$"):
        C.moe_route(x, router, 2, "relu", True, w, i)
    with pytest.raises(ValueError, match=r"^router: expected shape \[\*, 16\]"):
        C.moe_route(x, torch.randn(4, 15), 2, "softmax", True, w, i)
    with pytest.raises(ValueError, match="ids: expected dtype int64"):
        C.moe_route(x, router, 2, "softmax", True, w, i.int())
    with pytest.raises(ValueError, match="weights: expected shape"):
        C.moe_route(x, router, 2, "softmax", True, torch.empty(3, 2), i)
