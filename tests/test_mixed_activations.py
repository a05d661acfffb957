"""CPU "mixed" linear activations: one int8 term for every row of the O,
gate/up and down projections of the middle layers (one_term_layers), two
int8 terms (int8x2) for every other matrix, the QKV projections included
(docs/kernels.md, "Mixed activations"). A row's arithmetic depends on its
layer and matrix, never on its role (prompt or generating); the marked
prompt rows only pick their attention kernel.

Oracles: the pure modes, each tested against its own arithmetic in
test_quant_linear_int8*.py. A split call (quant_linear's two_term_rows,
which mixed-bf16 and the one-term layers use) must be bitwise the two pure
calls concatenated, in every build; a "mixed" model must be bitwise the same
model with per-matrix pure modes (int8 in the middle layers' O, gate/up and
down, int8x2 elsewhere) on every kind of step, marked or not, and the C++
layer stack must equal the Python layers. The model runner marks the first
prompt row after decodes and verify rows.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from paged import _C_cpu as C
from test_layer_stack import BLOCK, LENGTHS, MAX_BLOCKS, step, tiny_config, tiny_weights
from test_quant_linear import QTYPES, random_weight
from test_quant_linear_int8 import SUPPORTED, run

from paged.backends.cpu.attention import CpuBackend
from paged.backends.cpu.quant_linear import CpuPackedLinear, one_term_layers
from paged.backends.cpu.worker import prepare_model
from paged.core.models import build_model


def split_call(x, qtype, qs, d, m, rows: int) -> torch.Tensor:
    out = torch.full((x.shape[0], qs.shape[0]), float("nan"))
    C.quant_linear(x, qtype, qs, d, m, out, "int8x2", rows)
    return out


@pytest.mark.parametrize("qtype", QTYPES)
def test_split_call_is_the_two_pure_calls(qtype):
    gen = torch.Generator().manual_seed(7)
    qs, d, m = random_weight(qtype, 72, 160, gen)
    x = torch.randn(41, 160, generator=gen) * 3
    threads = torch.get_num_threads()
    try:
        for name in SUPPORTED:
            C.set_linear_isa(name)
            for t in (1, 2):
                torch.set_num_threads(t)
                for rows in (0, 1, 3, 16, 40, 41, 99):
                    r = min(rows, 41)
                    want = torch.cat([run(x[:r], qtype, qs, d, m, "int8x2") if r else x.new_empty(0, 72),
                                      run(x[r:], qtype, qs, d, m, "int8") if r < 41 else x.new_empty(0, 72)])
                    got = split_call(x, qtype, qs, d, m, rows)
                    assert torch.equal(got, want), (name, t, rows)
    finally:
        C.set_linear_isa("auto")
        torch.set_num_threads(threads)
    # -1: every row two-term, as plain int8x2
    assert torch.equal(split_call(x, qtype, qs, d, m, -1), run(x, qtype, qs, d, m, "int8x2"))


def test_split_argument_errors():
    gen = torch.Generator().manual_seed(1)
    qs, d, m = random_weight("q8_0", 8, 64, gen)
    x, out = torch.randn(3, 64), torch.empty(3, 8)
    with pytest.raises(ValueError, match=r"two_term_rows: expected -1 \(all rows\), or >= 0 with activations "
                                         r"'int8x2', got 2 with activations 'int8'"):
        C.quant_linear(x, "q8_0", qs, d, m, out, "int8", 2)
    with pytest.raises(ValueError, match="two_term_rows"):
        C.quant_linear(x, "q8_0", qs, d, m, out, "int8x2", -2)


def model_with(activations, config, weights, per_matrix=None):
    """The tiny model with every packed matrix in ``activations``; per_matrix
    {attribute: mode} overrides single matrices (the Python path then runs:
    the stack needs one mode)."""
    backend = CpuBackend(config.num_heads, config.num_kv_heads, config.head_dim, BLOCK, torch.float32, "cpu")
    model = build_model(config, weights, torch.float32, "cpu", backend,
                        lambda t: CpuPackedLinear(t, activations=activations))
    for layer in model.layers:
        for attr, mode in (per_matrix or {}).items():
            getattr(layer, attr).activations = mode
    prepare_model(model)
    return model, backend


@pytest.fixture(scope="module")
def tiny():
    config = tiny_config()
    return config, tiny_weights(config)


def assert_stack_equals_python_on_mixed_steps(model, backend, config, monkeypatch) -> None:
    """Three steps (prompts alone, decodes beside a prompt chunk, decodes
    alone) with the first prompt row marked: the C++ stack's hidden states
    and KV caches bitwise the Python layers'."""
    rng = np.random.default_rng(5)
    tokens = [rng.integers(0, 96, size=n + 12).tolist() for n in LENGTHS]
    caches = {flag: backend.allocate_kv_cache(config.num_layers, len(LENGTHS) * MAX_BLOCKS) for flag in "10"}
    steps = [([(0, 0, 3), (1, 0, 17), (2, 0, 9), (3, 0, 20), (4, 0, 5)], 0),
             ([(0, 3, 1), (1, 17, 1), (2, 9, 1), (4, 5, 1), (3, 20, 10)], 4),
             ([(0, 4, 1), (1, 18, 1), (2, 10, 1), (3, 30, 1), (4, 6, 1)], 5)]
    for work, nd in steps:
        ids, pos, meta = step(tokens, work, nd)
        meta.first_prompt_row = int(meta.query_start_loc[nd])
        out = {}
        for flag in "10":
            monkeypatch.setenv("PAGED_LAYER_STACK", flag)
            out[flag] = model(ids, pos, caches[flag], meta)
        assert torch.equal(out["1"], out["0"]), (work, nd)
        for (k1, v1), (k0, v0) in zip(caches["1"], caches["0"]):
            assert torch.equal(k1, k0) and torch.equal(v1, v0)


def test_stack_equals_python_layers_on_a_mixed_step(monkeypatch):
    config = tiny_config(num_layers=5)
    weights = tiny_weights(config)
    model, backend = model_with("mixed", config, weights)
    assert_stack_equals_python_on_mixed_steps(model, backend, config, monkeypatch)


def test_runner_marks_prompt_rows_after_decodes_and_verifies(default_model_path):
    """Through the engine: a step with decodes, an n-gram verify and a prompt
    chunk; the first prompt row is the first row of the prompt chunk."""
    from paged.core.engine.engine import Engine
    from paged.core.engine.config import EngineConfig

    engine = Engine(EngineConfig(model=str(default_model_path), device="cpu", max_model_len=256, max_num_seqs=4,
                                 kv_cache_memory="32MiB", linear_activations="mixed",
                                 speculative_config='{"method": "ngram", "num_speculative_tokens": 3}'))
    assert engine.linear_activations == "mixed"
    seen = []
    runner = engine.runner
    build = runner.build_inputs

    def spy(out, tables):
        inp = build(out, tables)
        decode_rows = len(out.decodes) + sum(s.num_new_tokens for s in out.verifies)
        seen.append((inp.meta.first_prompt_row, decode_rows, len(out.verifies), bool(out.prefills)))
        return inp

    runner.build_inputs = spy
    from paged.core.engine.sampling_params import SamplingParams
    from paged.core.entrypoints.llm import LLM

    llm = LLM.from_engine(engine)
    repetitive = "one two three four one two three four one two three four one two"
    llm.generate([repetitive, "The capital of France is", "x " * 60],
                 SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    assert seen and all(first == rows for first, rows, _, _ in seen)
    assert any(v for _, _, v, _ in seen), "no step verified drafts: the verify rows went untested"


def test_one_term_layers_are_the_middle_three_fifths():
    assert one_term_layers(30) == range(6, 24)  # the default model: the window the gate measured
    assert list(one_term_layers(5)) == [1, 2, 3]
    for n in range(64):
        middle = one_term_layers(n)
        assert 0 not in middle and n - 1 not in middle  # the first and last layers keep two terms
        assert all(0 <= i < n for i in middle)
        if middle:
            assert middle.start == n - middle.stop  # as many outer layers at each end


def run_steps(model, backend, config, monkeypatch, stack: bool, marked: bool = True) -> list[torch.Tensor]:
    """The hidden states of four steps (prompts alone, decodes beside a
    prompt chunk, decodes alone, a prompt chunk alone) on a fresh cache,
    prompt rows marked as the runner marks them, or not marked at all."""
    monkeypatch.setenv("PAGED_LAYER_STACK", "1" if stack else "0")
    rng = np.random.default_rng(11)
    tokens = [rng.integers(0, 96, size=n + 12).tolist() for n in LENGTHS]
    caches = backend.allocate_kv_cache(config.num_layers, len(LENGTHS) * MAX_BLOCKS)
    outs = []
    for work, nd in ([(0, 0, 3), (1, 0, 17), (2, 0, 9), (3, 0, 20), (4, 0, 5)], 0), \
                    ([(0, 3, 1), (1, 17, 1), (2, 9, 1), (4, 5, 1), (3, 20, 10)], 4), \
                    ([(0, 4, 1), (1, 18, 1), (2, 10, 1), (3, 30, 1), (4, 6, 1)], 5), \
                    ([(1, 19, 6)], 0):
        ids, pos, meta = step(tokens, work, nd)
        meta.first_prompt_row = int(meta.query_start_loc[nd]) if marked else None
        outs.append(model(ids, pos, caches, meta))
    return outs


def per_matrix_oracle(config, weights, prompt_attention: str):
    """The model with plain int8 in the middle layers' O, gate/up and down
    and int8x2 everywhere else (the Python layers: per-matrix modes)."""
    ob = CpuBackend(config.num_heads, config.num_kv_heads, config.head_dim, BLOCK, torch.float32, "cpu")
    oracle = build_model(config, weights, torch.float32, "cpu", ob, lambda t: CpuPackedLinear(t, activations="int8x2"))
    for i in one_term_layers(config.num_layers):
        for w in (oracle.layers[i].o_proj, oracle.layers[i].gate_up, oracle.layers[i].down):
            w.activations = "int8"
    prepare_model(oracle)
    assert oracle.layer_stack is None
    ob.prompt_attention = prompt_attention  # mixed's prompt rows attend on their own kernel
    return oracle, ob


def test_every_row_takes_its_layers_arithmetic(monkeypatch):
    """A five-layer "mixed" model computes layers 1-3's O, gate/up and down on
    one term and everything else on two, for every row whatever its role:
    bitwise the per-matrix oracle on steps of prompt rows, decodes beside a
    prompt chunk and decodes alone, from the stack and from the Python layers,
    with the prompt rows marked or not."""
    config = tiny_config(num_layers=5)
    weights = tiny_weights(config)
    mixed, backend = model_with("mixed", config, weights)
    assert mixed.layer_stack is not None
    assert [layer.o_proj.one_term for layer in mixed.layers] == [False, True, True, True, False]
    assert not any(layer.qkv.one_term for layer in mixed.layers)  # cached K/V: two terms
    oracle, ob = per_matrix_oracle(config, weights, backend.prompt_attention)
    for marked in (True, False):
        want = run_steps(oracle, ob, config, monkeypatch, stack=False, marked=marked)
        for stack in (False, True):
            got = run_steps(mixed, backend, config, monkeypatch, stack, marked)
            for i, (g, w) in enumerate(zip(got, want)):
                assert torch.equal(g, w), f"marked={marked}, stack={stack}, step {i}"

    # and the setting matters: without it every step is the all-int8x2 model's
    for layer in mixed.layers:
        for w in (layer.o_proj, layer.gate_up, layer.down):
            w.one_term = False
    two_terms = run_steps(mixed, backend, config, monkeypatch, stack=False)
    int8x2, xb = model_with("int8x2", config, weights)
    xb.prompt_attention = backend.prompt_attention
    assert all(torch.equal(a, b) for a, b in zip(two_terms, run_steps(int8x2, xb, config, monkeypatch, False)))
    assert not any(torch.equal(a, b) for a, b in zip(two_terms, want))


def test_one_term_needs_mixed():
    from torch.utils.dlpack import to_dlpack as dl

    config = tiny_config()
    model, _ = model_with("int8x2", config, tiny_weights(config))
    native = model.layer_stack._native
    layer = model.layers[0]
    mat = lambda w: (w.kernel_qtype, dl(w.qs), dl(w.d), None if w.m is None else dl(w.m))  # noqa: E731
    with pytest.raises(ValueError, match=r"one_term: expected false unless the stack's activations "
                                         r"are 'mixed', got true with activations 'int8x2'"):
        native.add_layer(dl(layer.input_norm.detach()), dl(layer.post_norm.detach()), [mat(layer.qkv)], None,
                         mat(layer.o_proj), mat(layer.gate_up), mat(layer.down), [], True)
    assert native.num_layers == config.num_layers
