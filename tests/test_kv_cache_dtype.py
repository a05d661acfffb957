"""--kv-cache-dtype: a bfloat16, int8 or fp8_e4m3 KV cache under a float32 (or
bfloat16) model on the CPU.

Oracles: the reference backend with the same cache dtype (plain torch; its
int8 / float8_e4m3fn rows are computed independently of the kernels,
backends/reference/kv_quant.py), torch's own float8_e4m3fn conversion, a
Python statement of the quantization's bounds, and the engine itself (a prefix-cache hit against a miss, batched against alone).
Kernel tolerance vs the reference over the same cache: 1e-5 of max |ref|
with float32 queries, 2e-2 with bfloat16 (only summation order and the
output's rounding differ); the conformance checks (core/conformance/
kv_cache_checks.py) run the same comparison for any platform.
"""

from __future__ import annotations

import os

import pytest
import torch

from paged import _C_cpu as C
from paged.backends.cpu.attention import CpuBackend
from paged.backends.reference.attention import ReferenceBackend
from paged.backends.reference.kv_quant import dequantize, quantize_fp8, quantize_int8
from paged.core.conformance import kernel_checks as kc
from paged.core.engine.engine import Engine
from paged.core.engine.config import EngineConfig
from paged.core.entrypoints.llm import LLM
from paged.core.engine.sampling_params import SamplingParams

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
ISAS = C.supported_attention_isas()


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """The reference's SDPA on one thread: on a loaded 2-core machine a
    2-thread region waits for a descheduled sibling (the kernels under test
    run their own pool)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(params=ISAS)
def isa(request):
    C.set_attention_isa(request.param)
    yield request.param
    C.set_attention_isa("auto")


def make(cls, case, dtype, kv):
    return cls(case.num_heads, case.num_kv_heads, case.head_size, case.block_size, dtype,
               sliding_window=case.sliding_window, kv_cache_dtype=kv)


CASES = [  # decode and prefill, GQA, block sizes 16 / 32 / 128, head sizes 64 / 80 / 128, a window,
    # sequences over 256 keys (split and combined)
    kc.AttnCase(4, 4, 64, 16, (1, 16, 17, 300)),
    kc.AttnCase(9, 3, 128, 32, (400, 31), sliding_window=100),
    kc.AttnCase(8, 2, 80, 128, (129, 260)),
    kc.AttnCase(9, 3, 64, 16, (300, 90, 33), query_lens=(40, 17, 1)),
    kc.AttnCase(6, 2, 128, 128, (129, 2), query_lens=(1, 2)),
]
_reference: dict = {}


def reference(case, dtype, kv):
    """(cache, output) of the reference backend, computed once per case."""
    key = (case, dtype, kv)
    if key not in _reference:
        be, batch = make(ReferenceBackend, case, dtype, kv), kc.make_batch(case, dtype)
        cache = kc.filled_cache(be, batch)
        _reference[key] = batch, cache, kc.run_attention(be, batch, case, kv=cache)
    return _reference[key]


FP8 = torch.float8_e4m3fn


def _bytes(t):
    return t.view(torch.uint8) if t.dtype == FP8 else t


@pytest.mark.parametrize("kv", [torch.int8, FP8, torch.bfloat16], ids=["int8", "fp8", "bf16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["q_f32", "q_bf16"])
def test_kernels_match_reference(isa, kv, dtype):
    for case in CASES:
        batch, ref_kv, ref_out = reference(case, dtype, kv)
        be = make(CpuBackend, case, dtype, kv)
        got_kv = kc.filled_cache(be, batch)
        assert got_kv[0].dtype == kv
        assert torch.equal(_bytes(got_kv[0]), _bytes(ref_kv[0])) and torch.equal(_bytes(got_kv[1]), _bytes(ref_kv[1]))
        err = kc._rel_error(kc.run_attention(be, batch, case, kv=got_kv), ref_out)
        assert err <= TOL[dtype], (isa, case, err)


def test_int8_rows_follow_the_stated_quantization():
    """Per (token, head): the largest |x| maps to +-127, every value is within
    half a step of its dequantized value, a zero row stays zero."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(50, 3, 64, generator=g) * torch.logspace(-3, 3, 50)[:, None, None]
    x[7, 1] = 0.0
    rows = quantize_int8(x)
    assert rows.shape == (50, 3, 68) and rows.dtype == torch.int8
    q, scale = rows[..., :64], rows[..., 64:].contiguous().view(torch.float32)[..., 0]
    amax = x.abs().amax(-1)
    assert torch.equal(scale, amax / 127)
    assert torch.equal(q.abs().amax(-1)[amax > 0], torch.full_like(amax[amax > 0], 127, dtype=torch.int8))
    err = (dequantize(rows) - x).abs()
    assert bool((err <= scale[..., None] * (0.5 + 1e-5)).all())
    assert not rows[7, 1, :64].any() and scale[7, 1] == 0


def test_fp8_rows_follow_the_stated_quantization():
    """Per (token, head): the largest |x| maps to +-448 (e4m3fn's largest
    value), every value is within half an e4m3fn step (relative 2^-4, or
    2^-10 absolute in the subnormals) of its dequantized value, a zero row
    stays zero."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(50, 3, 64, generator=g) * torch.logspace(-3, 3, 50)[:, None, None]
    x[7, 1] = 0.0
    rows = quantize_fp8(x)
    assert rows.shape == (50, 3, 68) and rows.dtype == FP8
    q, scale = rows[..., :64].float(), rows[..., 64:].contiguous().view(torch.float32)[..., 0]
    amax = x.abs().amax(-1)
    assert torch.equal(scale, amax / 448)
    assert bool((q.abs().amax(-1)[amax > 0] == 448).all())
    y = x / torch.where(scale > 0, scale, 1)[..., None]
    assert bool(((q - y).abs() <= torch.maximum(y.abs() / 16, torch.full_like(y, 2.0**-10)) * (1 + 1e-6)).all())
    assert not rows[7, 1].view(torch.uint8)[:64].any() and scale[7, 1] == 0


def test_fp8_conversion_is_torchs_bit_for_bit():
    """The kernels' float -> e4m3fn (kernel_common.h) against torch's, over a
    dense sweep of float32 bit patterns in [0, 448] (normals and subnormals),
    every tie between neighbouring e4m3fn values and its neighbours one ulp
    away, signed; and the reads (read_kv) against torch's widening."""
    sweep = torch.arange(0, 0x43E00001, 1021, dtype=torch.int64).to(torch.int32).view(torch.float32)
    values = torch.arange(128, dtype=torch.uint8).view(FP8).float()[:127]  # every finite non-negative code
    ties = (values[:-1] + values[1:]) / 2  # exact in float32
    near = torch.cat([ties, torch.nextafter(ties, ties + 1), torch.nextafter(ties, ties - 1), values])
    x = torch.cat([sweep, near, torch.tensor([0.0, 448.0])])
    x = torch.cat([x, -x])
    got = torch.empty(x.shape[0], dtype=FP8)
    C.to_fp8_e4m3fn(x, got)
    want = x.to(FP8)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), x[got.view(torch.uint8) != want.view(torch.uint8)]
    # reads: every code with scale 1 through read_kv, vs torch's float8 -> float32
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]  # NaN codes
    n = codes.numel() // 16 * 16
    rows = torch.cat([codes[:n].view(-1, 16), torch.tensor([1.0]).view(torch.uint8).expand(n // 16, 4)], 1)
    cache = rows.view(FP8).view(n // 16, 1, 1, 20).contiguous()
    k, v = torch.empty(n // 16, 1, 16), torch.empty(n // 16, 1, 16)
    C.read_kv(cache, cache, torch.arange(n // 16), k, v)
    assert torch.equal(k.flatten(), codes[:n].view(FP8).float())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("level", ["auto", "scalar"])
def test_half_cache_writes_are_torchs_conversion_bit_for_bit(dtype, level, monkeypatch):
    """reshape_and_cache of float32 tokens into a float16 / bfloat16 cache
    (the vectorised row conversion, and the scalar one under
    PAGED_CPU_HIDE=avx2 in a child) against torch's .to(dtype): a sweep of
    float32 bit patterns over every exponent, half's rounding ties and
    overflow edge, subnormals, signed zeros, infinities and NaN (as NaN)."""
    sweep = torch.arange(0, 0x7F800000, 65521, dtype=torch.int64).to(torch.int32).view(torch.float32)
    edges = torch.tensor([65504.0, 65519.0, 65520.0, 1e5, 6.1e-5, 6e-8, 2.98e-8, 3e-8, 1e-40, 0.0,
                          float("inf"), float("nan")])
    x = torch.cat([sweep, edges, torch.nextafter(edges, edges + 1)])
    x = torch.cat([x, -x])
    x = torch.cat([x, torch.zeros((-x.numel()) % 64)]).view(-1, 1, 64)  # tokens of one kv head of 64
    code = ("import sys, torch; from paged import _C_cpu as C; x = torch.load(sys.argv[1]); "
            "c = torch.zeros(x.shape[0], 1, 1, 64, dtype=x.new_empty(0, dtype=getattr(torch, sys.argv[2])).dtype); "
            "C.reshape_and_cache(x, x, c, c.clone(), torch.arange(x.shape[0])); torch.save(c, sys.argv[1])")
    if level == "scalar":
        import subprocess, sys, tempfile
        with tempfile.NamedTemporaryFile(suffix=".pt") as f:
            torch.save(x, f.name)
            env = {**os.environ, "PAGED_CPU_HIDE": "avx2"}
            subprocess.run([sys.executable, "-c", code, f.name, str(dtype).split(".")[1]], env=env, check=True)
            cache = torch.load(f.name)
    else:
        cache = torch.zeros(x.shape[0], 1, 1, 64, dtype=dtype)
        C.reshape_and_cache(x, x, cache, cache.clone(), torch.arange(x.shape[0]))
    got, want = cache.view(-1), x.view(-1).to(dtype)
    same = (got.view(torch.int16) == want.view(torch.int16)) | (got.isnan() & want.isnan())
    assert bool(same.all()), x.view(-1)[~same][:8]


def test_fp8_kernel_loads_are_exact(isa):
    """Every build's Vec::load_fp8 widens all 256 codes exactly (NaN codes to
    NaN): one visible key with scale 1 gives softmax weight 1, so the output
    is the V row's values themselves, equal to torch's float8_e4m3fn ->
    float32."""
    codes = torch.arange(256, dtype=torch.uint8)
    v = torch.zeros(1, 2, 16, 132, dtype=torch.uint8)
    v[0, :, 0, :128] = codes.view(2, 128)
    v[0, :, 0, 128:] = torch.tensor([1.0]).view(torch.uint8)
    k = torch.zeros_like(v)
    out = torch.empty(1, 2, 128)
    C.paged_attention(out, torch.zeros(1, 2, 128), k.view(FP8), v.view(FP8), torch.zeros(1, 1, dtype=torch.int32),
                      torch.ones(1, dtype=torch.int32), 0.1)
    got, want = out.flatten(), codes.view(FP8).float()
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan) and nan.sum() == 2
    assert torch.equal(got[~nan], want[~nan])  # -0 reads as -0 but leaves the FMA as +0


def test_cache_sizes_and_errors():
    f32 = CpuBackend(8, 2, 64, 128, torch.float32)
    i8 = CpuBackend(8, 2, 64, 128, torch.float32, kv_cache_dtype=torch.int8)
    bf = CpuBackend(8, 2, 64, 128, torch.float32, kv_cache_dtype=torch.bfloat16)
    assert i8.kv_cache_shape(3) == (3, 2, 128, 68)
    f8 = CpuBackend(8, 2, 64, 128, torch.float32, kv_cache_dtype=FP8)
    assert f8.kv_cache_shape(3) == (3, 2, 128, 68) and f8.bytes_per_block(30) == i8.bytes_per_block(30)
    assert bf.bytes_per_block(30) * 2 == f32.bytes_per_block(30)
    assert i8.bytes_per_block(30) * 256 == f32.bytes_per_block(30) * 68  # 4x fewer bytes, plus the scales
    ((k, v),) = i8.allocate_kv_cache(1, 2)
    assert k.dtype == torch.int8 and k.shape == (2, 2, 128, 68)
    with pytest.raises(ValueError, match="key_cache dim 3 minus the 4 scale bytes"):
        C.paged_attention(torch.empty(1, 8, 64), torch.empty(1, 8, 64), torch.zeros(2, 2, 128, 64, dtype=torch.int8),
                          torch.zeros(2, 2, 128, 64, dtype=torch.int8), torch.zeros(1, 1, dtype=torch.int32),
                          torch.ones(1, dtype=torch.int32), 0.1)
    with pytest.raises(ValueError, match="^--kv-cache-dtype: expected one of"):
        EngineConfig(kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="key_cache: expected dtype float32, bfloat16, float16, int8 or float8_e4m3fn"):
        C.paged_attention(torch.empty(1, 8, 64), torch.empty(1, 8, 64), torch.zeros(2, 2, 16, 68, dtype=torch.float8_e5m2),
                          torch.zeros(2, 2, 16, 68, dtype=torch.float8_e5m2), torch.zeros(1, 1, dtype=torch.int32),
                          torch.ones(1, dtype=torch.int32), 0.1)


def test_platforms_refuse_what_they_do_not_implement():
    from paged.platforms.cpu import CpuPlatform
    from paged.platforms.cuda import CudaPlatform
    from paged.platforms.npu import NpuPlatform

    def worker(platform):  # what runs on a device is its worker's to say
        return platform.worker_cls()(platform)

    cpu = worker(CpuPlatform())
    assert cpu.kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert cpu.kv_cache_dtype("int8", torch.float32) == torch.int8
    assert cpu.kv_cache_dtype("fp8_e4m3", torch.float32) == FP8
    for p in (CudaPlatform(), NpuPlatform()):
        w = worker(p)
        assert w.kv_cache_dtype("float16", torch.float16) == torch.float16  # its own dtype
        for choice in ("int8", "fp8_e4m3"):
            with pytest.raises(ValueError, match=f"^--kv-cache-dtype on {p.name}: expected one of auto, float16 "
                                                 f"\\(.*got '{choice}'$"):
                w.kv_cache_dtype(choice, torch.float16)


# -- the engine ------------------------------------------------------------------
PROMPTS = ["The capital of France is", "def fib(n):", "Once upon a time", "List three colors:",
           "In 1492, Columbus", "Water boils at"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def _engine(path, kv):
    # 16-token blocks so that a short shared prefix fills whole blocks (prefix hits)
    return LLM.from_engine(Engine(EngineConfig(
        model=str(path), device="cpu", dtype="float32", max_model_len=512, max_num_seqs=8,
        max_num_batched_tokens=256, kv_cache_memory="64MiB", block_size=16, kv_cache_dtype=kv,
        cpu_threads_bind=str(min(os.sched_getaffinity(0))), warm_up=False)))


@pytest.fixture(scope="module")
def int8_llm(default_model_path, isa_level):
    return _engine(default_model_path, "int8")


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def assert_prefix_hit_same_as_miss(llm, country):
    prompt = "You are a helpful assistant who answers questions about geography briefly. " * 2
    prompt += f"Q: What is the capital of {country}? A:"
    miss = llm.generate(prompt, GREEDY)[0]
    hit = llm.generate(prompt, GREEDY)[0]
    assert miss.metrics.num_cached_tokens == 0 and hit.metrics.num_cached_tokens >= 16
    assert hit.outputs[0].token_ids == miss.outputs[0].token_ids


def test_int8_prefix_hit_same_as_miss_and_batched_same_as_alone(int8_llm):
    assert_prefix_hit_same_as_miss(int8_llm, "Italy")
    alone = [tokens(int8_llm.generate(p, GREEDY))[0] for p in PROMPTS[:3]]
    assert tokens(int8_llm.generate(PROMPTS[:3] * 2, GREEDY)) == alone * 2


_exact: dict = {}


def exact_tokens(path, level):
    """Greedy tokens with the float32 cache, computed once per ISA level."""
    if level not in _exact:
        _exact[level] = tokens(_engine(path, "auto").generate(PROMPTS, GREEDY))
    return _exact[level]


def agreement(name, exact, quant):
    """Reported, not asserted token for token: quantized K/V change near-tie
    choices. The floor only catches a broken path (garbage agrees ~0%)."""
    same = sum(a == b for x, y in zip(exact, quant) for a, b in zip(x, y))
    total = sum(len(x) for x in exact)
    print(f"{name} KV greedy agreement with the float32 cache: {same}/{total} tokens")
    assert same >= total // 2


def test_int8_greedy_agreement_with_the_unquantized_cache(default_model_path, isa_level, int8_llm):
    agreement("int8", exact_tokens(default_model_path, isa_level), tokens(int8_llm.generate(PROMPTS, GREEDY)))


def test_fp8_engine_prefix_hit_same_as_miss_and_agreement(default_model_path, isa_level):
    llm = _engine(default_model_path, "fp8_e4m3")
    assert_prefix_hit_same_as_miss(llm, "Spain")
    agreement("fp8_e4m3", exact_tokens(default_model_path, isa_level), tokens(llm.generate(PROMPTS, GREEDY)))
