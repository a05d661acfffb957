"""Mixture-of-experts families against HF transformers float32 (the oracle),
on every path paged runs them, as tests/test_families.py checks the dense
ones.

Per family (tests/moe_models.py: Mixtral as a GGUF ``llama`` file,
Qwen3-MoE with Q/K norms and renormalised top-k, Qwen2-MoE with a
sigmoid-gated shared expert and raw top-k weights), a tiny random model is
saved as an HF folder and written to GGUF at F32 and Q8_0 (3-D expert
tensors, a float32 router), then:

- both loaders describe the same experts;
- the Python layers with the reference backend (the torch loop over
  experts every platform runs): logits within 2e-4 of HF's over a batched
  prefill and greedy decode, greedy tokens equal but at HF near-ties;
- the CPU with packed Q8_0 experts: float32 activations close to HF; the
  default (mixed) plan bitwise the same alone as batched and prefilled in
  chunks as whole, each expert's matrices called once per step whatever the
  number of rows that chose it, the C++ stack declined, the one-call C++
  experts bitwise the torch ops over the same matrices, and -tp 2 (thread
  ranks, the torch ops) bitwise -tp 1 (the one-call experts);
- 3-D expert tensors of each packed type split into exact per-expert
  packed matrices;
- a bfloat16 Qwen3-MoE on the simulated NPU equals the reference backend;
- ``paged generate`` and the LLM API serve the Q8_0 file;
- MoE files paged does not run are refused in one line naming what.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

transformers = pytest.importorskip("transformers")
_C = pytest.importorskip("paged._C_cpu")

from family_models import PagedRunner, greedy_run, one_thread  # noqa: E402,F401 (one_thread: autouse)
from moe_models import FAMILIES, build, hf_on, write_gguf  # noqa: E402
from test_families import (NEW, assert_matches_hf, cpu_model, hf_logits, prompts, reference_model,  # noqa: E402
                           scenario)

from paged.core.engine.distributed.local_group import ThreadRanks  # noqa: E402
from paged.core.engine.distributed.parallel_ops import TensorParallelOps  # noqa: E402
from paged.core.engine.distributed.sharding import local_config, plan_shards, shard_weights  # noqa: E402
from paged.core.models.loaders import ModelLoadError, load_model_files  # noqa: E402
from paged.core.models.moe import route  # noqa: E402
from paged.core.models.spec import MoeSpec  # noqa: E402


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    return build(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def packed(family):
    fam, hf, files = family
    return fam, hf, load_model_files(files["q8_0"], torch.float32, quiet=True, keep_packed=True)


# -- the description ------------------------------------------------------------------

def test_loaders_describe_the_experts(family):
    fam, hf, files = family
    loaded = {k: load_model_files(p, torch.float32, quiet=True) for k, p in files.items()}
    cfg = hf.config
    want = MoeSpec(getattr(cfg, "num_local_experts", None) or cfg.num_experts, cfg.num_experts_per_tok,
                   getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size,
                   normalize=fam.name != "qwen2moe",
                   shared_intermediate_size=getattr(cfg, "shared_expert_intermediate_size", 0) or 0,
                   shared_gate=fam.name == "qwen2moe")
    for k, v in loaded.items():
        assert v.config.architecture == fam.name, k
        assert [layer.moe for layer in v.config.spec.layers] == [want] * fam.layers, k


@pytest.mark.parametrize("keys,says", [
    (dict(expert_gating_func=2, expert_weights_norm=0), "sigmoid False"),
    (dict(expert_gating_func=7), "expert_gating_func: expected 1 (softmax) or 2 (sigmoid), got 7"),
    (dict(expert_used_count=9), "moe top_k: expected at most num_experts (6), got 9"),
], ids=["sigmoid-raw", "bad-gating", "top-k-over-experts"])
def test_gguf_expert_metadata(tmp_path, keys, says):
    """llama.cpp's expert_gating_func / expert_weights_norm keys choose the
    scoring and renormalisation; a bad value is one line naming the key."""
    fam, hf, files = build("qwen3moe", tmp_path)
    path = write_gguf(fam, hf, files["hf"], tmp_path / "keys.gguf", **keys)
    if says.startswith("sigmoid"):
        moe = load_model_files(path, quiet=True).config.spec.layers[0].moe
        assert f"{moe.scoring} {moe.normalize}" == says
        return
    with pytest.raises(ModelLoadError) as e:
        load_model_files(path, quiet=True)
    assert says in str(e.value) and "\n" not in str(e.value), str(e.value)


# -- the Python layers against HF ------------------------------------------------------

@pytest.mark.parametrize("source", ["hf", "f32", "q8_0"])
def test_python_layers_match_hf(family, source):
    fam, hf, files = family
    loaded = load_model_files(files[source], torch.float32, quiet=True)
    model, backend = reference_model(loaded)
    ps = prompts(loaded.config.vocab_size)
    ours, generated = greedy_run(model, backend, loaded.config.num_layers, ps, NEW)
    oracle = hf if source != "q8_0" else hf_on(hf, Q.Q8_0)
    worst = assert_matches_hf(ours, generated, hf_logits(oracle, ps, generated), 2e-4)
    print(f"{fam.name} {source}: max |logit diff| vs HF {worst:.1e}")


# -- the CPU: packed experts, the plan, tensor parallelism ------------------------------

def test_cpu_float32_activations_match_hf(packed):
    fam, hf, loaded = packed
    model, backend = cpu_model(loaded.config, loaded.weights, "float32")
    ps = prompts(loaded.config.vocab_size)
    ours, generated = greedy_run(model, backend, loaded.config.num_layers, ps, NEW)
    assert_matches_hf(ours, generated, hf_logits(hf_on(hf, Q.Q8_0), ps, generated), 1e-3)


def attention_builds() -> list[str]:
    """auto, and the avx512 attention build where it runs (its lane-major
    prompt kernel, which "mixed" takes there, changes the values the router
    and gates see: a qwen2moe gate computed with torch.sigmoid broke chunk
    invariance only there)."""
    return ["auto"] + (["avx512"] if "avx512" in _C.supported_attention_isas() else [])


@pytest.mark.parametrize("attention", attention_builds())
def test_cpu_default_plan_is_batch_invariant_and_chunk_invariant(packed, attention):
    fam, hf, loaded = packed
    _C.set_attention_isa(attention)
    try:
        check_default_plan_invariance(fam, hf, loaded)
    finally:
        _C.set_attention_isa("auto")


def check_default_plan_invariance(fam, hf, loaded):
    c = loaded.config
    model, backend = cpu_model(c, loaded.weights, "mixed", kv_dtype=torch.float16)
    assert model.layer_stack is not None  # the C++ stack, each layer's experts called back in Python
    ps = prompts(c.vocab_size) + [[5, 9, 17, 3, 44, 61, 2]]
    batched, gen = greedy_run(model, backend, c.num_layers, ps, NEW)
    for i, p in enumerate(ps):
        alone, g = greedy_run(model, backend, c.num_layers, [p], NEW)
        assert g[0] == gen[i] and torch.equal(alone[0], batched[i]), f"{fam.name}: sequence {i} alone vs batched"
    chunked, g = greedy_run(model, backend, c.num_layers, ps, NEW, chunk=7)
    assert g == gen and all(torch.equal(a, b) for a, b in zip(chunked, batched)), f"{fam.name}: chunked prefill"
    ref = hf_logits(hf_on(hf, Q.Q8_0), ps, gen)
    assert max((o - r).abs().max().item() for o, r in zip(batched, ref)) < 0.05


class CountingLinear:
    """A packed matrix that counts its calls (and the rows they carried)."""

    def __init__(self, inner):
        self.inner, self.calls, self.rows = inner, 0, 0

    def linear(self, x, bias=None, **kw):
        self.calls += 1
        self.rows += x.shape[0]
        return self.inner.linear(x, bias, **kw)


def test_each_expert_is_called_once_per_step(packed, monkeypatch):
    """The Python path's grouping (the layer stack, which runs the experts
    natively, off)."""
    monkeypatch.setenv("PAGED_LAYER_STACK", "0")
    fam, hf, loaded = packed
    c = loaded.config
    model, backend = cpu_model(c, loaded.weights, "mixed", kv_dtype=torch.float16)
    for layer in model.layers:
        layer.moe.gate_up = [CountingLinear(w) for w in layer.moe.gate_up]
        layer.moe.down = [CountingLinear(w) for w in layer.moe.down]
        layer.moe._fused_ops = None  # the one-call experts the stack made hold the unwrapped matrices
    ps = prompts(c.vocab_size)
    runner = PagedRunner(model, backend, c.num_layers, 64, 2)
    with torch.inference_mode():
        runner.step([0, 1], [ps[0][:30], ps[1][:20]], [0, 0])
    k = c.spec.layers[0].moe.top_k
    for i, layer in enumerate(model.layers):
        for mats in (layer.moe.gate_up, layer.moe.down):
            assert all(m.calls <= 1 for m in mats), f"layer {i}: {[m.calls for m in mats]}"
            assert sum(m.rows for m in mats) == 50 * k  # every row's k choices, each once
            assert sum(m.calls for m in mats) >= 2  # 50 rows did not all choose the same experts


def test_cpu_experts_in_one_call_give_the_python_path_bits(packed):
    """The CPU's one-call experts (csrc_cpu/model/moe_experts.h) beside the
    torch ops over the same packed matrices: equal bits at 1, 3 and 17 rows
    (rows sharing experts), the same expert runs; bad ids are one line."""
    fam, hf, loaded = packed
    c = loaded.config
    model, _ = cpu_model(c, loaded.weights, "mixed", kv_dtype=torch.float16)
    gen = torch.Generator().manual_seed(3)
    for i in (0, len(model.layers) // 2):  # an outer (two-term) and a middle (one-term) layer
        moe = model.layers[i].moe
        fused = moe._fused_experts(model.ops)
        assert fused is not None, f"{fam.name}: layer {i} has no one-call experts"
        for rows in (1, 3, 17):
            x = torch.randn(rows, c.hidden_size, generator=gen)
            weights, ids = route(torch.randn(rows, len(moe.gate_up), generator=gen), moe.spec)
            runs = moe.expert_runs
            want = moe._grouped(x, model.ops, weights, ids, None)
            python_runs, runs = moe.expert_runs - runs, moe.expert_runs
            got, fused_runs = fused(x, ids, weights)
            assert torch.equal(got, want), f"{fam.name}: layer {i}, {rows} rows"
            assert fused_runs == python_runs == len(set(ids.flatten().tolist()))
    bad = ids.clone()
    bad[0, 0] = len(moe.gate_up)
    with pytest.raises(ValueError, match=r"^ids: expected expert ids in \[0, \d+\), got \d+ at slot 0$"):
        fused(x, bad, weights)


def test_cpu_experts_spread_over_two_threads_give_the_python_path_bits(packed):
    """On 2 threads the one-call experts run the chosen experts in one
    parallel region per matrix kind (spread_experts) or each expert's call
    split on its own: both equal the Python path's bits on 1 thread."""
    fam, hf, loaded = packed
    c = loaded.config
    model, _ = cpu_model(c, loaded.weights, "mixed", kv_dtype=torch.float16)
    gen = torch.Generator().manual_seed(5)
    moe = model.layers[0].moe
    fused = moe._fused_experts(model.ops)
    cases = []
    for rows in (1, 4, 17):
        x = torch.randn(rows, c.hidden_size, generator=gen)
        weights, ids = route(torch.randn(rows, len(moe.gate_up), generator=gen), moe.spec)
        cases.append((x, weights, ids, moe._grouped(x, model.ops, weights, ids, None)))
    torch.set_num_threads(2)  # the one_thread fixture restores it
    for spread in (True, False):
        fused._native.spread_experts = spread
        for x, weights, ids, want in cases:
            got, _ = fused(x, ids, weights)
            assert torch.equal(got, want), f"{fam.name}: spread {spread}, {x.shape[0]} rows"
    fused._native.spread_experts = True


@pytest.mark.parametrize("activations", ["mixed", "int8x2"])
def test_layer_stack_runs_moe_layers_bitwise_as_python_layers(packed, activations, monkeypatch):
    """The C++ layer stack takes a mixture of experts: attention, norms,
    projections, routing, experts and a shared expert with its gate
    (Qwen2-MoE) in C++ (MoeExperts.forward); prompt, decode and mixed steps
    bitwise the Python layers (hidden states and KV caches), and every
    layer's experts still run."""
    from test_layer_stack import check_scenario

    fam, hf, loaded = packed
    c = loaded.config
    model, backend = cpu_model(c, loaded.weights, activations)
    assert model.layer_stack is not None, fam.name
    runs = [layer.moe.expert_runs for layer in model.layers]
    check_scenario(model, backend, monkeypatch, c.vocab_size)
    assert all(layer.moe.expert_runs > r for layer, r in zip(model.layers, runs))
    # routing, experts and the shared expert (Qwen2-MoE) ran in C++, not through the callback
    assert all(layer.moe._fused.stack_runs > 0 for layer in model.layers), fam.name


def test_stack_experts_take_a_checked_router_and_stand_down_without_one(packed):
    """The layer stack's native MLP (MoeExperts.forward) is ready only with
    the layer's router set; a bad router, top-k or shared expert is refused
    naming the value."""
    fam, hf, loaded = packed
    c = loaded.config
    model, _ = cpu_model(c, loaded.weights, "mixed", kv_dtype=torch.float16)
    moe = model.layers[0].moe
    native = moe._fused_experts(model.ops)._native
    assert native.ready, fam.name  # the stack set its router
    fresh = _C.MoeExperts(c.hidden_size, moe.spec.intermediate_size, "mixed")
    assert not fresh.ready  # no router, no experts
    experts = len(moe.gate_up)
    if moe.shared is not None:
        from paged.backends.cpu.moe_experts import _matrix

        def arrays(w):  # DLPack capsules are read once: fresh ones per call
            return _matrix(w)[0]

        gate_up, down = moe.shared
        with pytest.raises(ValueError, match=r"^shared down: expected \["):
            native.set_shared(arrays(gate_up), arrays(gate_up), None, None, None)
        with pytest.raises(ValueError, match=rf"^shared_gate: expected shape \[1, {c.hidden_size}\]"):
            native.set_shared(arrays(gate_up), arrays(down), None, None, torch.zeros(2, c.hidden_size))
    with pytest.raises(ValueError, match=rf"^router: expected shape \[{experts}, {c.hidden_size}\]"):
        native.set_router(torch.zeros(experts + 1, c.hidden_size), 2, "softmax", True)
    with pytest.raises(ValueError, match=rf"^top_k: expected in \[1, experts = {experts}\], got 0$"):
        native.set_router(torch.zeros(experts, c.hidden_size), 0, "softmax", True)
    native.set_router(torch.zeros(experts, c.hidden_size), 2, "sigmoid", False)
    assert native.ready


def test_cpu_experts_read_their_weight_panels(packed, monkeypatch):
    """Planned by the worker, every expert matrix keeps only its persistent
    panels (avx512 build); the one-call experts read them, bitwise the same
    model without panels, and under another linear build make themselves
    again from that build's arrays (unpacked from the panels)."""
    from paged.backends.cpu.worker import panel_matrices
    from paged.backends.cpu.quant_linear import plan_weight_panels

    if "avx512" not in _C.supported_linear_isas():
        pytest.skip("weight panels need the avx512 linear build, which this CPU cannot run")
    fam, hf, loaded = packed
    c = loaded.config
    _C.set_linear_isa("avx512")
    try:
        monkeypatch.setenv("PAGED_CPU_WEIGHT_PANELS", "1")
        on, _ = cpu_model(c, loaded.weights, "mixed", kv_dtype=torch.float16)
        plan_weight_panels(panel_matrices(on))
        off, _ = cpu_model(c, loaded.weights, "mixed", kv_dtype=torch.float16)
        experts = [w for layer in on.layers for w in layer.moe.gate_up + layer.moe.down]
        assert all(w.use_panels and w.packed_released for w in experts)
        gen = torch.Generator().manual_seed(7)
        for name in ["avx512"] + [n for n in _C.supported_linear_isas() if n not in ("avx512", "amx")][:1]:
            _C.set_linear_isa(name)
            for i in (0, len(on.layers) // 2):
                moe, ref = on.layers[i].moe, off.layers[i].moe
                fused = moe._fused_experts(on.ops)
                for rows in (1, 5, 17):
                    x = torch.randn(rows, c.hidden_size, generator=gen)
                    weights, ids = route(torch.randn(rows, len(moe.gate_up), generator=gen), moe.spec)
                    got, _ = fused(x, ids, weights)
                    want, _ = ref._fused_experts(off.ops)(x, ids, weights)
                    assert torch.equal(got, want), f"{fam.name}: {name}, layer {i}, {rows} rows"
                assert fused._native.panels_match_build
    finally:
        _C.set_linear_isa("auto")


def test_tensor_parallel_two_ranks_compute_one_process_bits(packed):
    fam, hf, loaded = packed
    c, w = loaded.config, loaded.weights
    ps = prompts(c.vocab_size)
    single, _ = cpu_model(c, w, "mixed", kv_dtype=torch.float16)
    want = scenario(single, c.num_layers, ps)
    group = ThreadRanks(2)
    shards = plan_shards(c, 2)
    width = c.spec.layers[0].moe.intermediate_size
    assert shards[0].expert_inter[0] == 0 and shards[0].expert_inter[1] == shards[1].expert_inter[0] < width
    assert shards[1].expert_inter[1] == width  # each rank a slice of every expert
    ranks = [cpu_model(local_config(c, s), shard_weights(w, c, s), "mixed",
                       TensorParallelOps(group.comm(s.rank), s), torch.float16)[0] for s in shards]
    got = group.run([lambda _comm, m=m: scenario(m, c.num_layers, ps) for m in ranks])
    for rank, outs in enumerate(got):
        for step, (a, b) in enumerate(zip(outs, want)):
            assert torch.equal(a, b), f"{fam.name}: rank {rank} step {step}"


# -- serving ---------------------------------------------------------------------------

def test_llm_api_serves_the_family(family):
    from paged.core.engine.config import EngineConfig
    from paged.core.engine.engine import Engine
    from paged.core.engine.sampling_params import SamplingParams
    from paged.core.entrypoints.llm import LLM

    fam, hf, files = family
    engine = Engine(EngineConfig(model=str(files["q8_0"]), device="cpu", max_model_len=128, max_num_seqs=4,
                                 kv_cache_memory="16MiB", warm_up=False))
    assert engine.model_config.architecture == fam.name
    llm = LLM.from_engine(engine)
    chat = engine.tokenizer.apply_chat_template([{"role": "user", "content": "hello world, the tree"}])
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    alone = llm.generate([chat], params)[0].outputs[0].token_ids
    together = llm.generate(["the a is", chat, "hello"], params)[1].outputs[0].token_ids
    assert len(alone) == 6 and alone == together


def test_paged_generate_cli_serves_a_moe_gguf(tmp_path):
    from test_cli_env import paged

    fam, hf, files = build("qwen3moe", tmp_path)
    result = paged("--device", "cpu", "generate", "--model", str(files["q8_0"]), "hello world",
                   "--max-tokens", "4", "--max-model-len", "128", "--temperature", "0")
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr and result.stdout.strip(), (result.stdout, result.stderr)


# -- what is refused ---------------------------------------------------------------------

def _tiny_gguf(path, arch: str, tensors: dict[str, np.ndarray], experts: int = 0):
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in (("block_count", 1), ("context_length", 64), ("embedding_length", 32),
                       ("feed_forward_length", 32), ("attention.head_count", 2), ("vocab_size", 8)):
        w.add_uint32(f"{arch}.{key}", value)
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(1)
    for name, data in tensors.items():
        w.add_tensor(name, data.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("arch,tensors,experts,says", [
    ("deepseek2", {"blk.0.ffn_gate_exps.weight": np.zeros((4, 32, 32))}, 4,
     "unsupported architecture 'deepseek2' (a mixture of experts)"),
    ("gpt-oss", {}, 8, "unsupported architecture 'gpt-oss' (a mixture of experts)"),
    ("qwen3", {"blk.0.ffn_gate_exps.weight": np.zeros((4, 32, 32))}, 0,
     "mixture-of-experts tensor 'blk.0.ffn_gate_exps.weight' is not supported for architecture 'qwen3'"),
    ("llama", {"blk.0.ffn_gate.0.weight": np.zeros((32, 32))}, 0,
     "mixture-of-experts tensor 'blk.0.ffn_gate.0.weight' is not supported for architecture 'llama'"),
], ids=["deepseek2", "gpt-oss", "experts-in-a-dense-family", "old-per-expert-mixtral"])
def test_unsupported_moe_is_refused_in_one_line(tmp_path, arch, tensors, experts, says):
    path = _tiny_gguf(tmp_path / "m.gguf", arch, tensors, experts)
    with pytest.raises(ModelLoadError) as e:
        load_model_files(path, quiet=True)
    assert says in str(e.value) and "\n" not in str(e.value), str(e.value)


# -- routing -----------------------------------------------------------------------------

def test_route_scores_and_renormalises_as_specified():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0], [0.2, 0.0, 1.0, -2.0]])
    soft = route(logits, MoeSpec(4, 2, 32))
    p = torch.softmax(logits, -1)
    assert soft[1].tolist() == [[3, 0], [2, 0]]
    torch.testing.assert_close(soft[0], torch.stack([p[0, [3, 0]], p[1, [2, 0]]]) /
                               torch.stack([p[0, [3, 0]].sum(), p[1, [2, 0]].sum()]).unsqueeze(1))
    raw = route(logits, MoeSpec(4, 2, 32, normalize=False))
    torch.testing.assert_close(raw[0], torch.stack([p[0, [3, 0]], p[1, [2, 0]]]))
    sig = route(logits, MoeSpec(4, 2, 32, scoring="sigmoid", normalize=False))
    torch.testing.assert_close(sig[0], torch.sigmoid(torch.tensor([[3.0, 2.0], [1.0, 0.2]])))


# -- the simulated NPU -------------------------------------------------------------------

from test_npu_sim import sim  # noqa: E402,F401  (the simulator fixture)


def test_qwen3moe_in_bfloat16_on_the_simulated_npu(sim, tmp_path, monkeypatch):
    """The torch-op MoE block beside NpuBackend (tests/npu_sim: torch_npu
    simulated on CPU tensors) in bfloat16: a batched prefill and greedy
    decode equal to the reference backend's on the same weights. No NPU
    operator is MoE-specific; this is not an NPU run (docs/models.md)."""
    import family_models as fm
    import paged_npu_sim

    from paged.backends.npu.attention import NpuBackend
    from paged.backends.reference.attention import ReferenceBackend
    from paged.core.models import build_model

    paged_npu_sim.uninstall()  # transformers probes torch_npu when it builds a model: make it first
    try:
        build("qwen3moe", tmp_path)
    finally:
        assert paged_npu_sim.NpuSimPlatform().is_available().ok
    monkeypatch.setattr(fm, "BLOCK", 128)  # the NPU's block size
    loaded = load_model_files(tmp_path / "hf", torch.bfloat16, quiet=True)
    c = loaded.config
    g = torch.Generator().manual_seed(1)
    ps = [torch.randint(10, c.vocab_size, (n,), generator=g).tolist() for n in (24, 13, 19)]
    runs = {}
    for name, cls in (("npu", NpuBackend), ("reference", ReferenceBackend)):
        be = cls(c.num_heads, c.num_kv_heads, c.head_dim, 128, torch.bfloat16, "cpu")
        logits, tokens = greedy_run(build_model(c, loaded.weights, torch.bfloat16, "cpu", be), be, c.num_layers,
                                    ps, 4)
        runs[name] = torch.cat(logits).float(), tokens
    assert runs["npu"][1] == runs["reference"][1]
    gap = (runs["npu"][0] - runs["reference"][0]).abs().max().item()
    print(f"qwen3moe bf16 simulated NPU vs reference: max |logit diff| {gap:.3f}")
    assert gap < 0.05, gap


# -- experts kept packed ------------------------------------------------------------------

@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0], ids=lambda q: q.name)
def test_packed_experts_split_from_a_3d_tensor(tmp_path, qtype):
    """A 3-D expert tensor of a packed type becomes one packed matrix per
    expert holding exactly that expert's values (gguf's dequantization of
    the whole tensor), and the CPU's packed linear runs on each."""
    from paged.backends.cpu.quant_linear import CpuPackedLinear
    from paged.core.models.loaders.gguf_loader import _load_experts
    from paged.core.models.loaders.gguf_reader import read_gguf
    from paged.core.models.loaders.packed import PackedBlocks

    rng = np.random.default_rng(2)
    data = rng.standard_normal((5, 48, 64), dtype=np.float32)
    w = gguf.GGUFWriter(str(tmp_path / "e.gguf"), "qwen3moe")
    w.add_tensor("blk.0.ffn_up_exps.weight", gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _, tensors = read_gguf(tmp_path / "e.gguf")
    dense = _load_experts(tmp_path / "e.gguf", tensors[0], torch.float32, keep_packed=False)
    packed = _load_experts(tmp_path / "e.gguf", tensors[0], torch.float32, keep_packed=True)
    want = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(data, qtype), qtype))
    x = torch.randn(3, 64)
    assert len(dense) == len(packed) == 5
    for e, (d, p) in enumerate(zip(dense, packed)):
        assert isinstance(p, PackedBlocks) and p.shape == (48, 64)
        assert torch.equal(d, want[e]) and torch.equal(p.dequantize(torch.float32), want[e]), e
        torch.testing.assert_close(CpuPackedLinear(p).linear(x), x @ want[e].T, rtol=1e-5, atol=1e-4)


def test_worker_sees_every_expert_matrix(packed):
    """The CPU worker's view of a model built outside an engine (a plain
    packed factory, as benchmarks build them): its plan read from every
    matrix, experts included, and its matrix list (weight panels, the plan)
    holding every expert's gate/up and down."""
    import functools

    from paged.backends.cpu.precision import plan_of
    from paged.backends.cpu.quant_linear import CpuPackedLinear
    from paged.backends.cpu.worker import decoder_matrices, prepare_model
    from paged.backends.reference.attention import ReferenceBackend
    from paged.core.models import build_model

    fam, hf, loaded = packed
    c = loaded.config
    be = ReferenceBackend(c.num_heads, c.num_kv_heads, c.head_dim, 16, torch.float32, "cpu")
    model = build_model(c, loaded.weights, torch.float32, "cpu", be,
                        functools.partial(CpuPackedLinear, activations="mixed"))
    assert plan_of(model).activations == "mixed"
    prepare_model(model)
    moe = c.spec.layers[0].moe
    per_layer = 2 + 2 * moe.num_experts + (2 if moe.shared_intermediate_size else 0)
    mats = decoder_matrices(model)
    assert len(mats) == c.num_layers * per_layer and all(isinstance(w, CpuPackedLinear) for w in mats)
    assert model.layer_stack is None  # the reference backend's attention: the Python layers
