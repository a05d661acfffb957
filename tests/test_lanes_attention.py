"""Lane-major float32 prompt attention (prefill_attention_lanes,
csrc_cpu/arch/x86/attention/prompt_lanes_avx512.cpp): what --linear-activations
mixed runs for prompt rows on AVX-512 CPUs (Zen 4, Xeons without AMX use).

Its definition is the float32 softmax(q * scale . k) . v with its own
summation order, so the oracle is the same product in float64 (within
float32 rounding); batch, chunk and thread-count invariance are bitwise,
through the conformance suite's own check with prefill routed to this
kernel; the layer stack bitwise the Python layers on a mixed model. Skipped
with the reason where the avx512 attention build does not run (AVX2-only
CPUs, or AVX-512 hidden); auto does not pick it, so the tests name it."""

from __future__ import annotations

import pytest
import torch

from paged import _C_cpu as C
from test_bf16_attention import CASES, check_prompt_attention_route, prefill_through, reference
from test_layer_stack import tiny_config

from paged.backends.cpu.attention import CpuBackend
from paged.core.conformance import kernel_checks as kc



@pytest.fixture(autouse=True)
def avx512_attention():
    """auto picks the avx2 attention (kernel_builds.cpp says why): the tests
    select the avx512 build by name, and skip where this CPU has none."""
    try:
        C.set_attention_isa("avx512")
    except ValueError as e:
        pytest.skip(f"the avx512 attention build does not run here: {e}")
    yield
    C.set_attention_isa("auto")


LanesPromptBackend = prefill_through("prefill_attention_lanes")


def as_float64(x: torch.Tensor) -> torch.Tensor:
    return x.double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", CASES + [kc.AttnCase(2, 1, 16, 7, (70, 5), query_lens=(70, 5))],
                         ids=lambda c: f"h{c.num_heads}/{c.num_kv_heads}d{c.head_size}")
def test_matches_the_definition_in_float64(case, dtype):
    be = kc.make_backend(LanesPromptBackend, case, "cpu", dtype)
    batch = kc.make_batch(case, dtype)
    kv = kc.filled_cache(be, batch)
    got = kc.run_attention(be, batch, case, kv).double()
    want = reference(be, batch, case, kv, be.scale, rounding=as_float64)
    vmax = max(float(kv[1].float().abs().max()), 1.0)
    tol = 2.0 ** -16 * vmax + (2.0 ** -8 * vmax if dtype != torch.float32 else 0.0)  # + the output's rounding
    assert (got - want).abs().max().item() <= tol
    # and the shared float32 kernel agrees within its own rounding
    f32 = kc.run_attention(kc.make_backend(CpuBackend, case, "cpu", dtype), batch, case, kv).double()
    assert (f32 - want).abs().max().item() <= tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_batch_chunk_and_thread_invariance_is_bitwise(dtype):
    """The conformance suite's invariance check (alone vs batched, batch
    order, chunked prefill, 1 vs 2 threads), prefill through this kernel."""
    assert kc.check_batch_invariance(LanesPromptBackend, "cpu", dtype) == 0.0


def test_argument_errors():
    case = kc.AttnCase(4, 2, 64, 16, (40,), query_lens=(40,))
    batch = kc.make_batch(case, torch.float32)
    be = CpuBackend(4, 2, 64, 16, torch.float32, "cpu", kv_cache_dtype=torch.int8)
    k, v = be.allocate_kv_cache(1, batch.num_blocks)[0]
    q = torch.zeros(40, 4, 64)
    with pytest.raises(ValueError, match=r"key_cache: expected float32, bfloat16 or float16"):
        be.prefill_attention_lanes(torch.empty_like(q), q, k, v, batch.query_start_loc, batch.seq_lens,
                                   batch.block_tables, be.scale)
    assert not C.lanes_prompt_attention_reads(k)
    be = CpuBackend(4, 2, 64, 16, torch.float32, "cpu")
    k, v = be.allocate_kv_cache(1, batch.num_blocks)[0]
    with pytest.raises(ValueError, match=r"query_start_loc"):  # prefill_attention's own checks
        be.prefill_attention_lanes(torch.empty(40, 4, 64), q, k, v, torch.tensor([0, 39], dtype=torch.int32),
                                   batch.seq_lens, batch.block_tables, be.scale)


def test_a_lower_isa_turns_it_off():
    try:
        C.set_attention_isa("avx2")
        assert not C.lanes_prompt_attention_supported()
        be = CpuBackend(4, 2, 64, 16, torch.float32, "cpu")
        k, _ = be.allocate_kv_cache(1, 4)[0]
        assert not C.lanes_prompt_attention_reads(k)
        with pytest.raises(RuntimeError, match="avx512 attention build"):
            be.prefill_attention_lanes(torch.empty(4, 4, 64), torch.zeros(4, 4, 64), k, k,
                                       torch.tensor([0, 4], dtype=torch.int32), torch.tensor([4], dtype=torch.int32),
                                       torch.zeros(1, 4, dtype=torch.int32), be.scale)
    finally:
        C.set_attention_isa("avx512")
    assert C.lanes_prompt_attention_supported()


def test_stack_equals_python_layers_with_lanes_prompt_attention(monkeypatch):
    """mixed: check_prompt_attention_route."""
    check_prompt_attention_route("mixed", "lanes", "prefill_attention_lanes", tiny_config(), monkeypatch)
