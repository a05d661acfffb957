"""Every family against HF transformers float32 on the same weights (the
oracle), on every path paged runs it.

Per family (tests/family_models.py: Llama 3.x with llama3 RoPE, Qwen3 with
Q/K norms, an explicit head_dim and tied embeddings, Gemma 3 with local and
global layers, Phi-3 with LongRoPE, partial rotary, a window and fused
tensors), a tiny random model is saved as an HF folder and written to GGUF
at F32 and Q8_0, then:

- the loaders describe it (both sources give the same decoder, but for
  Gemma's norm offset, which GGUF stores applied) with its stop tokens and
  chat template;
- the Python layers (reference attention) on each source: logits within
  2e-4 of HF's on the weights the source holds (Q8_0: HF on the dequantized
  matrices) over a batched prefill and 8 batched greedy decode steps, greedy
  tokens equal but at HF near-ties;
- the CPU backend with packed Q8_0 matrices: float32 activations close to
  HF; the default (mixed) plan bitwise the same alone as batched, prefilled
  in chunks as whole (windowed families: the same tokens, logits within
  0.02: the CPU prompt attention's key steps follow the window edge of a
  query tile), on the C++ stack as on the Python layers (every family: the
  stack executes the description), and under -tp 2 (thread ranks) as in one
  process;
- the engine on the Q8_0 file: a chat request alone and beside others gives
  the same tokens, with the family's stop tokens.
"""

from __future__ import annotations


import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

transformers = pytest.importorskip("transformers")
_C = pytest.importorskip("paged._C_cpu")

from family_models import FAMILIES, PagedRunner, greedy_run, hf_on, make_hf, one_thread, write_gguf  # noqa: E402,F401 (one_thread: autouse)

from paged.backends.cpu.attention import CpuBackend  # noqa: E402
from paged.backends.cpu.layer_stack import decline_reason, shape_decline  # noqa: E402
from paged.backends.cpu.precision import PlannedPackedLinear, PrecisionPlan  # noqa: E402
from paged.backends.cpu.worker import ops_for, stack_for  # noqa: E402
from paged.backends.reference.attention import ReferenceBackend  # noqa: E402
from paged.core.engine.distributed.local_group import ThreadRanks  # noqa: E402
from paged.core.engine.distributed.parallel_ops import TensorParallelOps  # noqa: E402
from paged.core.engine.distributed.sharding import local_config, plan_shards, shard_weights  # noqa: E402
from paged.core.models import build_model  # noqa: E402
from paged.core.models.loaders import load_model_files  # noqa: E402

BLOCK = 16
NEW = 8
NEAR_TIE = 1e-3  # HF top-2 logit gap under which another argmax is a tie


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(Family, HF model, {source: path}) for one family."""
    fam = FAMILIES[request.param]
    d = tmp_path_factory.mktemp(fam.name)
    hf = make_hf(fam, d / "hf")
    files = {"hf": d / "hf", "f32": write_gguf(fam, hf, d / "f32.gguf"),
             "q8_0": write_gguf(fam, hf, d / "q8_0.gguf", Q.Q8_0)}
    return fam, hf, files


def prompts(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(1)
    return [rng.integers(0, vocab, n).tolist() for n in (40, 23)]


def hf_logits(hf, ps: list[list[int]], generated: list[list[int]]) -> list[torch.Tensor]:
    """HF's logits over each prompt and paged's continuation but its last
    token (teacher forced: where HF's argmax equals paged's token at every
    step, HF's own greedy decode is paged's)."""
    with torch.inference_mode():
        return [hf(torch.tensor([p + g[:-1]])).logits[0].float() for p, g in zip(ps, generated)]


def assert_matches_hf(ours, generated, ref, atol: float) -> float:
    worst = 0.0
    for i, (o, r, g) in enumerate(zip(ours, ref, generated)):
        assert o.shape == r.shape, (o.shape, r.shape)
        worst = max(worst, (o - r).abs().max().item())
        for step, token in enumerate(g):
            row = r[o.shape[0] - len(g) + step]
            if token != int(row.argmax()):
                top2 = row.topk(2).values
                assert (top2[0] - top2[1]).item() < NEAR_TIE, f"sequence {i} step {step}: {token} vs HF {int(row.argmax())}"
    assert worst < atol, f"max |logit difference| vs HF {worst:.2e} >= {atol}"
    return worst


def reference_model(loaded):
    c = loaded.config
    backend = ReferenceBackend(c.num_heads, c.num_kv_heads, c.head_dim, BLOCK, torch.float32, "cpu",
                               sliding_window=c.sliding_window)
    return build_model(c, loaded.weights, torch.float32, "cpu", backend), backend


def cpu_model(config, weights, activations: str, parallel=None, kv_dtype=torch.float32):
    """The CPU worker's model outside an engine: its plan, its backend (made
    with the plan's prompt kernel), its packed-weight factory (every matrix
    made with its role), its ops and stack: nothing set after it is built."""
    plan = PrecisionPlan(activations)
    backend = CpuBackend(config.num_heads, config.num_kv_heads, config.head_dim, BLOCK, torch.float32, "cpu",
                         sliding_window=config.sliding_window, kv_cache_dtype=kv_dtype,
                         prompt_attention=plan.prompt_attention)
    model = build_model(config, weights, torch.float32, "cpu", backend, PlannedPackedLinear(plan), parallel)
    model.ops = ops_for(model)
    model.layer_stack = stack_for(model) if parallel is None else None
    return model, backend


# -- the description ------------------------------------------------------------------

def test_loaders_describe_the_family(family):
    fam, hf, files = family
    loaded = {k: load_model_files(p, torch.float32, quiet=True) for k, p in files.items()}
    specs = {k: v.config.spec for k, v in loaded.items()}
    for k, v in loaded.items():
        assert v.config.architecture == fam.name, k
        assert sorted(v.config.stop_token_ids) == sorted(fam.stop), k
        assert v.chat_template == fam.template, k
    hf_spec, gguf_spec = specs["hf"], specs["f32"]
    assert specs["q8_0"] == gguf_spec
    for a, b in zip(hf_spec.layers, gguf_spec.layers):
        assert a.attention.sliding_window == b.attention.sliding_window
        assert a.attention.rope.dim(16) == b.attention.rope.dim(16)
        assert a.attention.scale_for(loaded["hf"].config.head_dim) == pytest.approx(
            b.attention.scale_for(loaded["f32"].config.head_dim))
        assert (a.attention.qk_norm is None) == (b.attention.qk_norm is None)
        assert a.mlp == b.mlp and (a.attn_post_norm is None) == (b.attn_post_norm is None)
        # Gemma: HF stores w for (1 + w), GGUF stores 1 + w
        assert a.attn_norm.offset == (1.0 if fam.name == "gemma3" else 0.0) and b.attn_norm.offset == 0.0
    assert hf_spec.tie_word_embeddings == gguf_spec.tie_word_embeddings == bool(hf.config.tie_word_embeddings)
    windows = [layer.attention.sliding_window for layer in hf_spec.layers]
    expected = {"gemma3": [8, 8, 8, 8, 8, 0, 8], "phi3": [24, 24]}.get(fam.name, [0] * fam.layers)
    assert windows == expected
    if fam.name == "phi3":
        assert hf_spec.layers[0].attention.rope.rotary_dim == 12
        assert hf_spec.layers[0].attention.rope.scaling["rope_type"] == "longrope"
    if fam.name == "gemma3":
        thetas = {layer.attention.rope.theta for layer in gguf_spec.layers}
        assert thetas == {10000.0, 1e6} and gguf_spec.embed_scale == pytest.approx(8.0)


# -- the Python layers against HF ------------------------------------------------------

@pytest.mark.parametrize("source", ["hf", "f32", "q8_0"])
def test_python_layers_match_hf(family, source):
    fam, hf, files = family
    loaded = load_model_files(files[source], torch.float32, quiet=True)
    model, backend = reference_model(loaded)
    ps = prompts(loaded.config.vocab_size)
    ours, generated = greedy_run(model, backend, loaded.config.num_layers, ps, NEW)
    oracle = hf if source != "q8_0" else hf_on(fam, hf, Q.Q8_0)
    worst = assert_matches_hf(ours, generated, hf_logits(oracle, ps, generated), 2e-4)
    print(f"{fam.name} {source}: max |logit diff| vs HF {worst:.1e}")


# -- the CPU: packed weights, the plan, the stack, tensor parallelism ----------------

@pytest.fixture(scope="module")
def packed(family):
    fam, hf, files = family
    loaded = load_model_files(files["q8_0"], torch.float32, quiet=True, keep_packed=True)
    return fam, hf, loaded


def test_cpu_float32_activations_match_hf(packed):
    fam, hf, loaded = packed
    model, backend = cpu_model(loaded.config, loaded.weights, "float32")
    ps = prompts(loaded.config.vocab_size)
    ours, generated = greedy_run(model, backend, loaded.config.num_layers, ps, NEW)
    assert_matches_hf(ours, generated, hf_logits(hf_on(fam, hf, Q.Q8_0), ps, generated), 1e-3)


def test_cpu_default_plan_is_batch_invariant_and_chunk_invariant(packed, monkeypatch):
    fam, hf, loaded = packed
    c = loaded.config
    model, backend = cpu_model(c, loaded.weights, "mixed", kv_dtype=torch.float16)
    ps = prompts(c.vocab_size)
    monkeypatch.setenv("PAGED_LAYER_STACK", "0")
    batched, gen = greedy_run(model, backend, c.num_layers, ps, NEW)
    for i, p in enumerate(ps):
        alone, g = greedy_run(model, backend, c.num_layers, [p], NEW)
        assert g[0] == gen[i] and torch.equal(alone[0], batched[i]), f"{fam.name}: sequence {i} alone vs batched"
    chunked, g = greedy_run(model, backend, c.num_layers, ps, NEW, chunk=7)
    assert g == gen, f"{fam.name}: chunked prefill's tokens"
    if c.spec.widest_window() == 0 and not any(c.spec.windows()):
        assert all(torch.equal(a, b) for a, b in zip(chunked, batched)), f"{fam.name}: chunked prefill"
    else:
        # The CPU prompt attention starts a query tile's key steps at its
        # first row's window edge, which moves with the chunking: windowed
        # layers sum in another order (csrc_cpu/attention/kernel_impl.inc,
        # ``lo``); an absolute step alignment would make it bitwise
        assert max((a - b).abs().max().item() for a, b in zip(chunked, batched)) < 0.02, fam.name
    # and close to HF: the int8 terms' error, not another model
    ref = hf_logits(hf_on(fam, hf, Q.Q8_0), ps, gen)
    assert max((o - r).abs().max().item() for o, r in zip(batched, ref)) < 0.05


def test_cpu_stack_equals_python_layers(packed, monkeypatch):
    """The C++ stack executes every family's description (Q/K norms, GELU-tanh,
    Gemma's four norms, local and global tables, partial rotary, LongRoPE,
    per-layer windows and scales) with the Python layers' bits."""
    fam, hf, loaded = packed
    c = loaded.config
    model, backend = cpu_model(c, loaded.weights, "mixed", kv_dtype=torch.float16)
    assert decline_reason(model) is None and model.layer_stack is not None, fam.name
    ps = prompts(c.vocab_size)
    runs = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("PAGED_LAYER_STACK", flag)
        runs[flag] = greedy_run(model, backend, c.num_layers, ps, NEW, chunk=9)
    assert runs["1"][1] == runs["0"][1]
    assert all(torch.equal(a, b) for a, b in zip(runs["1"][0], runs["0"][0])), fam.name


def test_stack_declines_what_it_has_no_kernels_for():
    """LayerNorm, an ungated MLP and norms of several eps in one layer: the
    stack names what it lacks (the model keeps the Python layers)."""
    from types import SimpleNamespace

    from paged.core.models.spec import LayerSpec, MlpSpec, NormSpec, uniform

    def stack(layer, final=NormSpec()):
        spec = uniform(2, layer, final_norm=final)
        return SimpleNamespace(spec=spec, layers=[SimpleNamespace(spec=s, moe=None) for s in spec.layers])

    assert shape_decline(stack(LayerSpec())) is None
    assert shape_decline(stack(LayerSpec(), NormSpec("layer"))) == "a LayerNorm final norm"
    assert shape_decline(stack(LayerSpec(mlp_norm=NormSpec("layer")))) == "layer 0: LayerNorm"
    assert shape_decline(stack(LayerSpec(mlp=MlpSpec(gated=False)))) == "layer 0: an ungated MLP"
    assert shape_decline(stack(LayerSpec(attn_post_norm=NormSpec(eps=1e-3)))) == "layer 0: norms of several eps"


def test_tensor_parallel_two_ranks_compute_one_process_bits(packed, monkeypatch):
    fam, hf, loaded = packed
    c, w = loaded.config, loaded.weights
    monkeypatch.setenv("PAGED_LAYER_STACK", "0")
    ps = prompts(c.vocab_size)
    single, _ = cpu_model(c, w, "mixed", kv_dtype=torch.float16)
    want = scenario(single, c.num_layers, ps)
    group = ThreadRanks(2)
    ranks = [cpu_model(local_config(c, s), shard_weights(w, c, s), "mixed",
                       TensorParallelOps(group.comm(s.rank), s), torch.float16)[0] for s in plan_shards(c, 2)]
    got = group.run([lambda _comm, m=m: scenario(m, c.num_layers, ps) for m in ranks])
    for rank, outs in enumerate(got):
        for step, (a, b) in enumerate(zip(outs, want)):
            assert torch.equal(a, b), f"{fam.name}: rank {rank} step {step}"


def scenario(model, num_layers: int, ps) -> list[torch.Tensor]:
    """Logits of a chunked prefill, a prompt chunk beside a decode, and a decode step."""
    backend = model.layers[0].attn_backend
    backend = getattr(backend, "backend", backend)
    runner = PagedRunner(model, backend, num_layers, 64, 2)
    out = []
    with torch.inference_mode():
        for seqs, chunks, starts, nd in (([0, 1], [ps[0][:20], ps[1][:23]], [0, 0], 0),
                                          ([1, 0], [[ps[1][5]], ps[0][20:40]], [23, 20], 1),
                                          ([0, 1], [[ps[0][3]], [ps[1][7]]], [40, 24], 2)):
            out.append(model.compute_logits(runner.step(seqs, chunks, starts, nd)))
    return out


# -- the engine ----------------------------------------------------------------------

def test_engine_serves_the_family(family):
    from paged.core.engine.config import EngineConfig
    from paged.core.engine.engine import Engine
    from paged.core.engine.sampling_params import SamplingParams
    from paged.core.entrypoints.llm import LLM

    fam, hf, files = family
    engine = Engine(EngineConfig(model=str(files["q8_0"]), device="cpu", max_model_len=128, max_num_seqs=4,
                                 kv_cache_memory="16MiB", warm_up=False))
    assert engine.model_config.architecture == fam.name
    assert engine.stop_token_ids == set(fam.stop)
    llm = LLM.from_engine(engine)
    chat = engine.tokenizer.apply_chat_template([{"role": "user", "content": "hello world, the tree"}])
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    alone = llm.generate([chat], params)[0].outputs[0].token_ids
    together = llm.generate(["the a is", chat, "hello"], params)[1].outputs[0].token_ids
    assert len(alone) == 6 and alone == together


# -- what one family's files may vary -------------------------------------------------

@pytest.mark.parametrize("name,overrides", [
    ("gemma3", dict(query_pre_attn_scalar=24, final_logit_softcapping=3.0, num_hidden_layers=2)),
    ("phi3", dict(partial_rotary_factor=1.0, sliding_window=None, original_max_position_embeddings=256,
                  rope_scaling=None)),
    ("qwen3", dict(use_sliding_window=True, sliding_window=6, max_window_layers=1)),
], ids=["gemma3-scale-softcap", "phi3-mini-plain-rope", "qwen3-window-layers"])
def test_variants_match_hf(tmp_path, name, overrides):
    """Gemma 3 with its own attention scale and a final logit soft-cap (two
    layers: the local/global pattern is the main test's),
    Phi-3 with whole-head plain RoPE and no window (the C++ stack's shape),
    Qwen3 with windows on its upper layers (layer_types): the HF folder
    through the Python layers against HF."""
    fam = FAMILIES[name]
    hf = make_hf(fam, tmp_path, seed=1, **overrides)
    loaded = load_model_files(tmp_path, torch.float32, quiet=True)
    model, backend = reference_model(loaded)
    ps = prompts(loaded.config.vocab_size)
    ours, generated = greedy_run(model, backend, loaded.config.num_layers, ps, NEW)
    assert_matches_hf(ours, generated, hf_logits(hf, ps, generated), 2e-4)
    if name == "gemma3":
        assert loaded.config.spec.final_logit_softcap == 3.0 and max(o.abs().max().item() for o in ours) <= 3.0
    if name == "qwen3":
        assert loaded.config.spec.windows() == [0, 6]
