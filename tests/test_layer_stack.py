"""The CPU LayerStack (all decoder layers of a step in one C++ call) against
its oracle, the Python layer path (PAGED_LAYER_STACK=0): the same kernels
with the same arguments, so hidden states and KV caches must be bitwise equal
after every step of a scenario with chunked prefill on a cached prefix,
mixed prefill + decode steps and decode batches of 5 and of 1."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from paged.core.models.config import ModelConfig
from paged.core.models.loaders.packed import PackedBlocks
from paged.core.models import build_model

_C = pytest.importorskip("paged._C_cpu")
gguf_quants = pytest.importorskip("gguf.quants")
from gguf import GGMLQuantizationType  # noqa: E402

from paged.backends.cpu.attention import CpuBackend  # noqa: E402
from paged.backends.cpu.quant_linear import CpuPackedLinear, available  # noqa: E402
from paged.backends.cpu.worker import prepare_model  # noqa: E402
from step_inputs import BLOCK, LENGTHS, MAX_BLOCKS, SCENARIO, step  # noqa: E402

if not (available() and hasattr(_C, "LayerStack")):
    pytest.skip("paged._C_cpu built without the LayerStack", allow_module_level=True)


# -- a tiny random-weight model on packed GGUF blocks ---------------------------------

def tiny_config(**overrides) -> ModelConfig:
    fields = dict(architecture="llama", vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=128)
    return ModelConfig(**{**fields, **overrides})


def packed(rng, rows: int, cols: int, qtype=GGMLQuantizationType.Q8_0) -> PackedBlocks:
    raw = gguf_quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32) * 0.2, qtype)
    return PackedBlocks(qtype, torch.from_numpy(np.ascontiguousarray(raw)), (rows, cols))


def tiny_weights(c: ModelConfig, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    dense = lambda *shape: torch.from_numpy(rng.standard_normal(shape).astype(np.float32))  # noqa: E731
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    w = {"model.embed_tokens.weight": dense(c.vocab_size, c.hidden_size),
         "model.norm.weight": 1 + 0.1 * dense(c.hidden_size),
         "lm_head.weight": dense(c.vocab_size, c.hidden_size)}
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        qtype = GGMLQuantizationType.Q4_1 if i % 2 else GGMLQuantizationType.Q8_0
        w[p + "input_layernorm.weight"] = 1 + 0.1 * dense(c.hidden_size)
        w[p + "post_attention_layernorm.weight"] = 1 + 0.1 * dense(c.hidden_size)
        for name, rows, cols in (("self_attn.q_proj", q, c.hidden_size), ("self_attn.k_proj", kv, c.hidden_size),
                                 ("self_attn.v_proj", kv, c.hidden_size), ("self_attn.o_proj", c.hidden_size, q),
                                 ("mlp.gate_proj", c.intermediate_size, c.hidden_size),
                                 ("mlp.up_proj", c.intermediate_size, c.hidden_size),
                                 ("mlp.down_proj", c.hidden_size, c.intermediate_size)):
            w[p + name + ".weight"] = packed(rng, rows, cols, qtype)
        if c.qkv_bias:
            for n, size in (("q", q), ("k", kv), ("v", kv)):
                w[p + f"self_attn.{n}_proj.bias"] = 0.5 * dense(size)
    return w


def make_model(config: ModelConfig, weights: dict):
    backend = CpuBackend(config.num_heads, config.num_kv_heads, config.head_dim, BLOCK, torch.float32,
                         "cpu", sliding_window=config.sliding_window)
    model = build_model(config, weights, torch.float32, "cpu", backend, CpuPackedLinear)
    prepare_model(model)  # what the CPU worker does: fused ops, the stack where eligible
    return model, backend


def check_scenario(model, backend, monkeypatch, vocab: int):
    assert model.layer_stack is not None, "the model should be eligible for the stack"
    rng = np.random.default_rng(1)
    tokens = [rng.integers(0, vocab, size=n + 12).tolist() for n in LENGTHS]
    n_layers = len(model.layers)
    caches = {flag: backend.allocate_kv_cache(n_layers, len(LENGTHS) * MAX_BLOCKS) for flag in ("1", "0")}
    for name, work, nd in SCENARIO:
        ids, pos, meta = step(tokens, work, nd)
        hidden = {}
        for flag in ("1", "0"):
            monkeypatch.setenv("PAGED_LAYER_STACK", flag)
            assert model.layer_stack.handles(len(ids)) == (flag == "1")
            hidden[flag] = model(ids, pos, caches[flag], meta)
        assert torch.equal(hidden["1"], hidden["0"]), name
        assert torch.isfinite(hidden["1"]).all(), name
        for layer, ((k1, v1), (k0, v0)) in enumerate(zip(caches["1"], caches["0"])):
            assert torch.equal(k1, k0) and torch.equal(v1, v0), f"{name}: layer {layer} KV cache"


@pytest.mark.parametrize("overrides", [{}, {"architecture": "qwen2", "qkv_bias": True},
                                       {"architecture": "mistral", "sliding_window": 8}],
                         ids=["llama", "qkv-bias", "sliding-window"])
def test_tiny_model_bitwise_equal_to_python_layers(overrides, monkeypatch, isa_level):
    config = tiny_config(**overrides)
    model, backend = make_model(config, tiny_weights(config))
    check_scenario(model, backend, monkeypatch, config.vocab_size)


@pytest.fixture(scope="module")
def default_packed_model(default_model_path):
    from paged.core.models.loaders import load_model_files

    loaded = load_model_files(default_model_path, torch.float32, quiet=True, keep_packed=True)
    return make_model(loaded.config, loaded.weights), loaded.config


def test_default_model_bitwise_equal_to_python_layers(default_packed_model, monkeypatch, isa_level):
    (model, backend), config = default_packed_model
    check_scenario(model, backend, monkeypatch, config.vocab_size)


def test_engine_greedy_tokens_same_with_and_without_stack(default_model_path, monkeypatch, isa_level):
    from paged.core.engine.engine import Engine
    from paged.core.engine.config import EngineConfig
    from paged.core.entrypoints.llm import LLM
    from paged.core.engine.sampling_params import SamplingParams

    engine = Engine(EngineConfig(model=str(default_model_path), device="cpu", dtype="float32", max_model_len=128,
                                 max_num_seqs=4, kv_cache_memory="32MiB"))
    assert engine.runner.model.layer_stack is not None
    llm = LLM.from_engine(engine)
    prompts = ["The capital of France is", "def fib(n):", "Once upon a time"]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    tokens = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("PAGED_LAYER_STACK", flag)
        tokens[flag] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert tokens["1"] == tokens["0"]


def test_not_eligible_keeps_python_path():
    config = tiny_config()
    weights = tiny_weights(config)
    backend = CpuBackend(config.num_heads, config.num_kv_heads, config.head_dim, BLOCK, torch.float32)
    dense_model = build_model(config, weights, torch.float32, "cpu", backend, None)  # dequantized weights
    prepare_model(dense_model)
    assert dense_model.layer_stack is None
    bf16 = CpuBackend(config.num_heads, config.num_kv_heads, config.head_dim, BLOCK, torch.bfloat16)
    bf16_model = build_model(config, weights, torch.bfloat16, "cpu", bf16, CpuPackedLinear)
    prepare_model(bf16_model)
    assert bf16_model.layer_stack is None


def test_bad_arguments_are_value_errors():
    from torch.utils.dlpack import to_dlpack as dl

    config = tiny_config()
    model, backend = make_model(config, tiny_weights(config))
    caches = backend.allocate_kv_cache(config.num_layers, 2 * MAX_BLOCKS)
    tokens = [list(range(8)), list(range(8))]
    ids, pos, meta = step(tokens, [(0, 0, 5), (1, 0, 3)], 0)
    stack = model.layer_stack
    with pytest.raises(ValueError, match=r"kv_caches: expected one \(key, value\) pair per layer \(2 layers\), got 1$"):
        model(ids, pos, caches[:1], meta)
    native = stack._native
    with pytest.raises(ValueError, match="kv_caches"):
        native.bind_kv_caches([(dl(k), dl(v)) for k, v in caches[:1]])
    model(ids, pos, caches, meta)  # binds the caches
    hidden = model.embed[ids].clone()
    cos_sin = model.rope.cos_sin_cache

    def run(hidden=hidden, out=None, positions=pos, slots=meta.slot_mapping, qsl=meta.query_start_loc,
            lens=meta.seq_lens, tables=meta.block_tables, nd=0):
        out = torch.empty_like(hidden) if out is None else out
        native.run(dl(hidden), dl(out), dl(positions), dl(cos_sin), dl(slots), dl(qsl), dl(lens), dl(tables), nd)

    with pytest.raises(ValueError, match="positions"):
        run(positions=pos[:-1])
    with pytest.raises(ValueError, match="slot_mapping"):
        run(slots=meta.slot_mapping[:-1])
    with pytest.raises(ValueError, match="hidden"):
        run(hidden=hidden[:, :-1].contiguous())
    with pytest.raises(ValueError, match="out"):
        run(out=torch.empty(len(ids) + 1, config.hidden_size))
    with pytest.raises(ValueError, match="num_decodes"):
        run(nd=3)
    with pytest.raises(ValueError, match="query_start_loc"):
        run(qsl=torch.tensor([0, 5, 7], dtype=torch.int32))
    with pytest.raises(ValueError, match="block_tables"):
        run(tables=meta.block_tables[:1].contiguous())
    with pytest.raises(ValueError, match="seq_lens"):
        run(lens=meta.seq_lens.to(torch.int64))
    with pytest.raises(IndexError):  # a slot outside the cache: the kernel's own check
        run(slots=torch.full_like(meta.slot_mapping, 10**6))
    layer = model.layers[0]
    mat = lambda w: (w.kernel_qtype, dl(w.qs), dl(w.d), None if w.m is None else dl(w.m))  # noqa: E731
    norms = dl(layer.input_norm.detach()), dl(layer.post_norm.detach())
    with pytest.raises(ValueError, match="qkv_bias"):
        native.add_layer(*norms, [mat(layer.qkv)], dl(torch.zeros(3)), mat(layer.o_proj), mat(layer.gate_up),
                         mat(layer.down))
    assert native.num_layers == config.num_layers  # the rejected layer was not added
