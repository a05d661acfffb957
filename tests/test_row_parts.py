"""Fused matrices whose rows come in several kernel layouts (Q4_K_M's QKV:
Q4_K Q/K rows, a Q6_K V) kept as row parts (core/models/loaders/packed.py
PackedParts): each part in its own layout, the outputs joined. Oracles:
gguf's dequantizer (values), each part run alone (bits), the Python layers
against the C++ layer stack (bits), and the s16 form they replace (bytes)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from paged.core.models.config import ModelConfig
from paged.core.models.loaders.packed import PackedBlocks, PackedFields, PackedParts, cat_rows

gguf_quants = pytest.importorskip("gguf.quants")
_C = pytest.importorskip("paged._C_cpu")

from gguf import GGMLQuantizationType as Q  # noqa: E402

from paged.backends.cpu.attention import CpuBackend, dl  # noqa: E402
from paged.backends.cpu.precision import PlannedPackedLinear, PrecisionPlan  # noqa: E402
from paged.backends.cpu.quant_linear import CpuPackedLinear  # noqa: E402
from paged.backends.cpu.worker import prepare_model  # noqa: E402
from paged.core.models import build_model  # noqa: E402
from step_inputs import BLOCK  # noqa: E402
from test_layer_stack import check_scenario  # noqa: E402
from test_quant_layouts import random_blocks  # noqa: E402


def blocks(qtype: Q, rows: int, cols: int, seed: int) -> PackedBlocks:
    return PackedBlocks(qtype, torch.from_numpy(random_blocks(qtype, rows, cols, seed)), (rows, cols))


def gguf_values(p: PackedBlocks) -> torch.Tensor:
    return torch.from_numpy(gguf_quants.dequantize(p.blocks.numpy(), p.qtype).reshape(p.shape).astype(np.float64))


QKV = [(Q.Q4_K, 64), (Q.Q4_K, 32), (Q.Q6_K, 32)]  # Q, K (Q4_K), V (Q6_K) rows


def qkv_parts(k: int = 512, seed: int = 0) -> list[PackedBlocks]:
    return [blocks(t, rows, k, seed + i) for i, (t, rows) in enumerate(QKV)]


def test_cat_rows_groups_consecutive_layouts():
    parts = qkv_parts()
    joined = cat_rows(parts, row_parts=True)
    assert isinstance(joined, PackedParts)
    assert [p.kernel_type for p in joined.parts] == ["q4_1", "s16"]
    assert joined.shape == (128, 512)
    want = torch.cat([gguf_values(p) for p in parts])
    assert torch.equal(joined.dequantize(torch.float64), want)
    fused = cat_rows(parts)  # a platform without row parts: every row s16, same values
    assert isinstance(fused, PackedFields) and fused.kernel_type == "s16"
    assert torch.equal(fused.dequantize(torch.float64), want)
    # the point: Q4_K rows in q4_1 (0.75 bytes a weight) instead of s16 with offsets (1.5)
    assert joined.nbytes < 0.7 * fused.nbytes
    # types of one layout (Q4_K and Q4_1 in q4_1) join as that layout's fields
    one = cat_rows([blocks(Q.Q4_K, 16, 256, 1), blocks(Q.Q4_1, 8, 256, 2)], row_parts=True)
    assert isinstance(one, PackedFields) and one.kernel_type == "q4_1" and one.shape == (24, 256)


S16_QKV = [(Q.Q3_K, 64), (Q.Q3_K, 32), (Q.Q5_K, 32)]  # Q3_K_L's QKV: Q3_K Q/K rows, a Q5_K V (both s16)


@pytest.mark.parametrize("activations", ["int8", "int8x2", "mixed"])
def test_s16_rows_of_several_types_are_parts_with_the_same_bits(activations):
    parts = [blocks(t, rows, 512, 20 + i) for i, (t, rows) in enumerate(S16_QKV)]
    joined, fused = cat_rows(parts, row_parts=True), cat_rows(parts)
    assert isinstance(joined, PackedParts) and [p.kernel_type for p in joined.parts] == ["s16", "s16"]
    want = torch.cat([gguf_values(p) for p in parts])
    assert torch.equal(joined.dequantize(torch.float64), want)
    lin, one = CpuPackedLinear(joined, activations), CpuPackedLinear(fused, activations)
    # each part packed as its own type (Q3_K's codes in 3 bits, no offsets), not every row in 6 bits with offsets
    assert [p.kernel_qtype for p in lin.parts] == ["s16.s3", "s16.u5"] and one.kernel_qtype == "s16.s6"
    held = lambda m: sum(t.numel() * t.element_size() for t in (m.qs, m.d, m.m) if t is not None)  # noqa: E731
    assert sum(held(p) for p in lin.parts) < 0.6 * held(one)
    for rows in (1, 5, 40):  # few-rows kernels and prompt tiles
        x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
        assert torch.equal(lin.linear(x), one.linear(x))  # the s16 contract per row: the same values either way


@pytest.mark.parametrize("activations", ["float32", "int8", "int8x2", "mixed"])
def test_row_parts_linear_is_its_parts(activations):
    parts = qkv_parts(seed=3)
    joined = cat_rows(parts, row_parts=True)
    lin = CpuPackedLinear(joined, activations)
    assert lin.qtype == "parts" and lin.shape == (128, 512)
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(5))
    bias = torch.randn(128, generator=torch.Generator().manual_seed(6))
    got = lin.linear(x, bias)
    alone = torch.cat([CpuPackedLinear(p, activations).linear(x) for p in joined.parts], dim=1) + bias
    assert torch.equal(got, alone)
    want = x.double() @ torch.cat([gguf_values(p) for p in parts]).T + bias.double()
    scale = x.double().abs() @ torch.cat([gguf_values(p) for p in parts]).abs().T
    tol = 1e-2 if activations == "int8" else 1e-4  # one int8 term keeps ~8 bits of x (docs/cpu-linear.md)
    assert ((got.double() - want).abs() <= tol * scale + 1e-5).all()
    with pytest.raises(ValueError, match="fused matrix of row parts"):
        lin.embedding(torch.tensor([0]))


def tiny_config() -> ModelConfig:
    # K-quants need rows of 256: hidden 256
    return ModelConfig(architecture="llama", vocab_size=96, hidden_size=256, intermediate_size=256, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=64, max_position_embeddings=128)


def tiny_weights(c: ModelConfig) -> dict:
    rng = np.random.default_rng(0)
    dense = lambda *shape: torch.from_numpy(rng.standard_normal(shape).astype(np.float32))  # noqa: E731

    def q8(rows, cols):
        raw = gguf_quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32) * 0.05, Q.Q8_0)
        return PackedBlocks(Q.Q8_0, torch.from_numpy(np.ascontiguousarray(raw)), (rows, cols))

    q, kv, h = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.hidden_size
    w = {"model.embed_tokens.weight": dense(c.vocab_size, h), "model.norm.weight": 1 + 0.1 * dense(h),
         "lm_head.weight": dense(c.vocab_size, h)}
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = 1 + 0.1 * dense(h)
        w[p + "post_attention_layernorm.weight"] = 1 + 0.1 * dense(h)
        w[p + "self_attn.q_proj.weight"] = blocks(Q.Q4_K, q, h, 10 * i)
        w[p + "self_attn.k_proj.weight"] = blocks(Q.Q4_K, kv, h, 10 * i + 1)
        w[p + "self_attn.v_proj.weight"] = blocks(Q.Q6_K, kv, h, 10 * i + 2)
        w[p + "self_attn.o_proj.weight"] = q8(h, q)
        w[p + "mlp.gate_proj.weight"] = q8(c.intermediate_size, h)
        w[p + "mlp.up_proj.weight"] = q8(c.intermediate_size, h)
        w[p + "mlp.down_proj.weight"] = q8(h, c.intermediate_size)
    return w


@pytest.mark.parametrize("plan", ["mixed", "int8x2"])
def test_layer_stack_runs_row_parts_bitwise_as_python_layers(plan, monkeypatch, isa_level):
    config = tiny_config()
    backend = CpuBackend(config.num_heads, config.num_kv_heads, config.head_dim, BLOCK, torch.float32, "cpu")
    model = build_model(config, tiny_weights(config), torch.float32, "cpu", backend,
                        PlannedPackedLinear(PrecisionPlan(plan)))
    prepare_model(model)
    qkv = model.layers[0].qkv
    assert [p.qtype for p in qkv.parts] == ["q4_1", "s16"]
    check_scenario(model, backend, monkeypatch, config.vocab_size)


def test_layer_stack_checks_row_parts():
    config = tiny_config()
    backend = CpuBackend(config.num_heads, config.num_kv_heads, config.head_dim, BLOCK, torch.float32, "cpu")
    model = build_model(config, tiny_weights(config), torch.float32, "cpu", backend,
                        PlannedPackedLinear(PrecisionPlan("int8x2")))
    prepare_model(model)
    native = model.layer_stack._native
    layer = model.layers[0]
    from paged.backends.cpu.layer_stack import _matrix, _row_parts

    def add(qkv):  # fresh DLPack capsules per call (a call consumes them)
        native.add_layer(dl(layer.input_norm.detach()), dl(layer.post_norm.detach()), qkv, None,
                         _matrix(layer.o_proj), _matrix(layer.gate_up), _matrix(layer.down))

    rows = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
    first = layer.qkv.parts[0].shape[0]
    with pytest.raises(ValueError, match=rf"qkv: expected row parts of {rows} rows in all, got 1 parts of {first}"):
        add(_row_parts(layer.qkv)[:1])
    with pytest.raises(ValueError, match=rf"qkv: expected row parts of {rows} rows in all, got 0 parts of 0"):
        add([])
    assert native.num_layers == config.num_layers
