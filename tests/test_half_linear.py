"""CPU linear on F16 / BF16 weights kept 16-bit (csrc_cpu/linear/half.h:
``_C_cpu.half_linear``, the "f16" / "bf16" layouts of CpuPackedLinear).

Oracles: the documented arithmetic evaluated exactly (each lane's fma chain
in rationals, rounded once per fma to float32) for every build this CPU
runs; x @ W^T in float64 within the bound the summation length gives; a
row's bits alone vs in calls of any size on 1 and 2 threads in every build;
the loader's 16-bit values against gguf's dequantizer; and a whole tiny F16
(and BF16) model's logits against HF transformers in float32, its matrices
and tied head held 16-bit under every activations setting.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import quants

from paged import _C_cpu as C
from test_quant_linear_int8 import round_f32

SUPPORTED = C.supported_linear_isas()
DTYPES = {"f16": torch.float16, "bf16": torch.bfloat16}


def weight(n: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random 16-bit weights with zeros, a negative zero and (float16) subnormals among them."""
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=gen) * 0.05).to(dtype)
    w.view(-1)[::13] = 0.0
    w.view(-1)[5::17] = -0.0
    if dtype == torch.float16:
        w.view(-1)[3::19] = 2.0 ** -20  # subnormal
    return w


def run(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    out = torch.full((x.shape[0], w.shape[0]), float("nan"))
    C.half_linear(x, w, out)
    return out


def exact_oracle(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """half.h's definition: eight fma chains over k % 8, then hsum8, each
    operation rounded once from its exact value."""
    xf, wf = x.double().tolist(), w.double().tolist()
    out = torch.empty(x.shape[0], w.shape[0])
    for r, xr in enumerate(xf):
        for n, wn in enumerate(wf):
            acc = [0.0] * 8
            for k, (a, b) in enumerate(zip(wn, xr)):
                acc[k % 8] = round_f32(Fraction(a) * Fraction(b) + Fraction(acc[k % 8]))
            add = lambda p, q: round_f32(Fraction(p) + Fraction(q))  # noqa: E731
            out[r, n] = add(add(add(acc[0], acc[4]), add(acc[2], acc[6])), add(add(acc[1], acc[5]), add(acc[3], acc[7])))
    return out


@pytest.mark.parametrize("layout", list(DTYPES))
def test_every_build_is_the_exact_definition(layout):
    w = weight(7, 45, DTYPES[layout], seed=1)  # K = 45: five chunks of 8 and a tail of 5
    x = torch.randn(4, 45, generator=torch.Generator().manual_seed(2))
    x[1, 3] = 0.0
    want = exact_oracle(x, w)
    try:
        for name in SUPPORTED:
            C.set_linear_isa(name)
            got = run(x, w)
            assert torch.equal(got.view(torch.int32), want.view(torch.int32)), name
    finally:
        C.set_linear_isa("auto")


@pytest.mark.parametrize("layout", list(DTYPES))
@pytest.mark.parametrize("shape", [(1, 30, 8), (3, 17, 100), (13, 50, 256), (5, 33, 1030)])
def test_within_the_summation_bound_of_the_float64_product(layout, shape):
    m, n, k = shape
    w = weight(n, k, DTYPES[layout], seed=k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * 3
    want = x.double() @ w.double().T
    # eight fma chains of ceil(K/8) terms, then three adds (half.h)
    bound = (math.ceil(k / 8) + 3) * 2.0 ** -24 * (x.double().abs() @ w.double().abs().T)
    for name in SUPPORTED:
        C.set_linear_isa(name)
        try:
            assert torch.all((run(x, w).double() - want).abs() <= bound), name
        finally:
            C.set_linear_isa("auto")


@pytest.mark.parametrize("layout", list(DTYPES))
def test_rows_alone_equal_rows_in_calls(layout):
    w = weight(70, 203, DTYPES[layout], seed=7)
    x = torch.randn(11, 203, generator=torch.Generator().manual_seed(3))
    threads = torch.get_num_threads()
    try:
        C.set_linear_isa("scalar")
        torch.set_num_threads(1)
        alone = torch.cat([run(x[i:i + 1], w) for i in range(11)])
        for name in SUPPORTED:
            C.set_linear_isa(name)
            for t in (1, 2):
                torch.set_num_threads(t)
                for size in (1, 2, 3, 4, 5, 7, 11):
                    got = torch.cat([run(x[i:i + size], w) for i in range(0, 11, size)])
                    assert torch.equal(got, alone), (name, t, size)
    finally:
        C.set_linear_isa("auto")
        torch.set_num_threads(threads)


def test_a_non_finite_row_stays_in_its_row():
    w = weight(20, 64, torch.float16, seed=4)
    x = torch.randn(3, 64)
    x[1, 10] = float("inf")
    x[2, 0] = float("nan")
    clean = run(x[:1], w)
    got = run(x, w)
    assert torch.equal(got[0], clean[0]) and not torch.isfinite(got[1:]).any()


def test_bad_arguments_are_one_clear_line():
    w = torch.zeros(4, 64, dtype=torch.float16)
    x, out = torch.zeros(2, 64), torch.zeros(2, 4)
    cases = [
        ((x, w.float(), out), "w: expected dtype float16 or bfloat16, got dtype float32"),
        ((x, w.to(torch.int16), out), "w: expected dtype float32, bfloat16 or float16"),
        ((torch.zeros(2, 32), w, out), r"x: expected shape \[M >= 1, 64\]"),
        ((x.double(), w, out), "x: expected dtype float32"),
        ((x, w, torch.zeros(2, 5)), r"out: expected shape \[2, 4\]"),
        ((x, w[:, ::2], out), "w: expected"),
        ((x, torch.zeros(4, 64, 1, dtype=torch.float16), out), "w: expected"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            C.half_linear(*args)


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16], ids=lambda q: q.name)
def test_loader_keeps_ggufs_values_16_bit(qtype):
    from paged.core.models.loaders.packed import PackedBlocks
    from paged.core.models.loaders.quant_layouts import dequantize_layout

    rng = np.random.default_rng(5)
    data = (rng.standard_normal((6, 96)) * 0.1).astype(np.float32)
    raw = quants.quantize(data, qtype)
    blocks = torch.from_numpy(np.ascontiguousarray(raw).view(np.uint8).reshape(6, -1).copy())
    packed = PackedBlocks(qtype, blocks, (6, 96))
    qs, d, m = packed.fields()
    assert packed.kernel_type == qtype.name.lower() and d is None and m is None
    assert qs.dtype == DTYPES[packed.kernel_type] and qs.shape == (6, 96)
    assert qs.untyped_storage().data_ptr() == blocks.untyped_storage().data_ptr()  # a view: no copy
    want = quants.dequantize(raw, qtype).reshape(6, 96)
    assert np.array_equal(dequantize_layout(packed.kernel_type, qs, d, m).numpy().view(np.uint32),
                          want.view(np.uint32))


def test_a_16_bit_part_among_other_types_fuses_dense():
    from paged.core.models.loaders.packed import PackedBlocks, cat_rows

    rng = np.random.default_rng(6)
    parts = []
    for qtype in (Q.F16, Q.Q8_0):
        raw = np.ascontiguousarray(quants.quantize(rng.standard_normal((2, 64)).astype(np.float32), qtype))
        parts.append(PackedBlocks(qtype, torch.from_numpy(raw.view(np.uint8).reshape(2, -1).copy()), (2, 64)))
    fused = cat_rows(parts)
    assert isinstance(fused, torch.Tensor) and fused.dtype == torch.float32
    assert torch.equal(fused, torch.cat([p.dequantize(torch.float32) for p in parts]))


# -- a whole F16 / BF16 model against HF float32 ---------------------------------------

@pytest.fixture(scope="module", params=[("qwen3", Q.F16), ("llama", Q.BF16)], ids=lambda p: f"{p[0]}-{p[1].name}")
def half_model(request, tmp_path_factory):
    """(family, HF model, the GGUF loaded packed) for a tiny model written at
    F16 (Qwen3: tied embeddings) or BF16 (Llama: its own head)."""
    pytest.importorskip("transformers")
    from family_models import FAMILIES, make_hf, write_gguf

    from paged.core.models.loaders import load_model_files

    name, qtype = request.param
    fam = FAMILIES[name]
    d = tmp_path_factory.mktemp(f"{name}-{qtype.name}")
    hf = make_hf(fam, d / "hf")
    loaded = load_model_files(write_gguf(fam, hf, d / "model.gguf", qtype), torch.float32, quiet=True,
                              keep_packed=True)
    return fam, hf, qtype, loaded


@pytest.mark.parametrize("activations", ["mixed", "float32"])
def test_16_bit_model_matches_hf_float32(half_model, activations, monkeypatch):
    from family_models import greedy_run, hf_on, one_thread  # noqa: F401 (one_thread: autouse)
    from test_families import NEW, assert_matches_hf, cpu_model, hf_logits, prompts

    from paged.backends.cpu.quant_linear import CpuPackedLinear

    fam, hf, qtype, loaded = half_model
    c = loaded.config
    model, backend = cpu_model(c, loaded.weights, activations)
    layout = qtype.name.lower()
    mats = [w for layer in model.decoder_stack().layers for _, w in layer.matrices()]
    assert mats and all(isinstance(w, CpuPackedLinear) and w.qtype == layout for w in mats)
    assert isinstance(model.embed, CpuPackedLinear) and model.embed.qtype == layout  # rows dequantized per lookup
    assert isinstance(model.lm_head, CpuPackedLinear) and model.lm_head.qtype == layout
    assert (model.lm_head is model.embed) == bool(hf.config.tie_word_embeddings)
    ps = prompts(c.vocab_size)
    batched, gen = greedy_run(model, backend, c.num_layers, ps, NEW)
    # HF on the weights the file holds (16-bit values, exact in float32): float32 math up to summation order
    assert_matches_hf(batched, gen, hf_logits(hf_on(fam, hf, qtype), ps, gen), 1e-4)
    for i, p in enumerate(ps):  # every setting runs the 16-bit matrices on half_linear: batch invariant
        alone, g = greedy_run(model, backend, c.num_layers, [p], NEW)
        assert g[0] == gen[i] and torch.equal(alone[0], batched[i]), f"sequence {i} alone vs batched"
