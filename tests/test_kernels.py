"""CPU attention / cache kernels (paged._C_cpu via CpuBackend) against the
pure-torch ReferenceBackend, through the shared checks of
core/conformance/kernel_checks.py, plus hypothesis-generated cases."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from paged.backends.reference.attention import ReferenceBackend
from paged.core.conformance import kernel_checks as kc

C = pytest.importorskip("paged._C_cpu", reason="the CPU extension is not built")
from paged.backends.cpu.attention import CpuBackend  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ISAS = C.supported_attention_isas()


@pytest.fixture(params=ISAS)
def isa(request):
    """Run a test once per kernel build this CPU supports (avx512/avx2/scalar)."""
    C.set_attention_isa(request.param)
    yield request.param
    C.set_attention_isa("auto")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_edge_cases(isa, dtype):
    kc.check_edge_cases(CpuBackend, "cpu", dtype, quick=isa != ISAS[0])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_random_cases(dtype):
    kc.check_random_attention(CpuBackend, "cpu", dtype, quick=dtype == torch.float16, seed=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_batch_invariance(isa, dtype):
    kc.check_batch_invariance(CpuBackend, "cpu", dtype)


@pytest.mark.parametrize("backend", [CpuBackend, ReferenceBackend], ids=lambda b: b.name)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cache_ops(backend, dtype):
    kc.check_cache_roundtrip(backend, "cpu", dtype)
    kc.check_copy_and_swap(backend, "cpu", dtype)


@pytest.mark.parametrize("backend", [CpuBackend, ReferenceBackend], ids=lambda b: b.name)
def test_argument_errors(backend):
    kc.check_argument_errors(backend, "cpu", torch.float32)


@st.composite
def cases(draw):
    hkv = draw(st.sampled_from([1, 2, 3]))
    bs = draw(st.sampled_from([16, 32, 48, 64, 128]))
    lens = draw(st.lists(st.integers(1, 700), min_size=1, max_size=4))
    prefill = draw(st.booleans())
    qlens = tuple(draw(st.integers(1, n)) for n in lens) if prefill else None
    return kc.AttnCase(
        num_heads=hkv * draw(st.sampled_from([1, 2, 3, 8])), num_kv_heads=hkv,
        head_size=draw(st.sampled_from([16, 64, 96, 128, 256])), block_size=bs,
        seq_lens=tuple(lens), query_lens=qlens,
        sliding_window=draw(st.sampled_from([0, 0, 1, 17, 256])),
        spare_blocks=draw(st.integers(0, 3)), pad_slots=draw(st.integers(0, 3)),
        seed=draw(st.integers(0, 2**16)))


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases(), dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_property_matches_reference(case, dtype):
    kc.compare_case(CpuBackend, "cpu", dtype, case)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_non_default_scale(dtype):
    case = kc.AttnCase(4, 2, 64, 16, (40, 3), query_lens=(9, 3))
    batch = kc.make_batch(case, dtype)
    outs = []
    for backend in (CpuBackend, ReferenceBackend):
        be = kc.make_backend(backend, case, "cpu", dtype)
        be.scale = 0.37
        outs.append(kc.run_attention(be, batch, case).float())
    assert (outs[0] - outs[1]).abs().max() <= kc.TOLERANCE[dtype] * outs[1].abs().max()


def test_isa_selection_errors():
    with pytest.raises(ValueError, match="not-an-isa"):
        C.set_attention_isa("not-an-isa")
    assert C.attention_isa() in ISAS
