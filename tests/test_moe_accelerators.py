"""The mixture-of-experts glue of the accelerators, on CPU tensors: what
runs on an NPU or a GPU is not run here.

- NPU (backends/npu/moe.py): torch_npu's MoE operators on the SIMULATOR
  (tests/npu_sim: each operator written from its documented formula; not an
  NPU run). The operators checked against the documentation's own example
  worked by hand; tiny Qwen3-MoE, Mixtral and Qwen2-MoE models
  (tests/moe_models.py) in bfloat16 through NpuBackend and the operators
  against the reference backend's torch loop over experts (the oracle):
  the same expert choices at every layer, greedy tokens equal, logits
  close; sigmoid scoring, raw (not renormalised) weights and the gated
  shared expert honoured; no host sync in the layer; a release without the
  operators runs the torch-op path and says which are missing.
- CUDA (backends/cuda/moe.py): the grouped-GEMM glue (sorting, offsets,
  empty groups, slot order, the choice-order sum) with the loop of matmuls
  that has grouped_mm's contract and with torch's own grouped_mm on the CPU,
  against the torch-op path on the same experts, through the same seam
  (``ops.moe_experts``); the real call on a GPU skips here without one.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from family_models import greedy_run  # noqa: E402
from moe_models import build  # noqa: E402
from test_npu_sim import sim  # noqa: E402,F401  (the simulator fixture)

from paged.backends.cuda import moe as cuda_moe  # noqa: E402
from paged.backends.cuda.layer_ops import CudaLayerOps  # noqa: E402
from paged.core.models import moe as moe_module  # noqa: E402
from paged.core.models.layers import SingleDevice, TorchLayerOps  # noqa: E402
from paged.core.models.moe import MoeMlp, route  # noqa: E402
from paged.core.models.spec import MlpSpec, MoeSpec  # noqa: E402


def synthetic_moe(spec: MoeSpec, hidden: int = 32, dtype=torch.float32, shared: int = 0, seed: int = 0) -> MoeMlp:
    """A layer of random dense experts (router scaled for clear choices)."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=0.2):
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    inter = spec.intermediate_size
    experts = [(rand(2 * inter, hidden), rand(hidden, inter)) for _ in range(spec.num_experts)]
    extra = {}
    if shared:
        extra = dict(shared=(rand(2 * shared, hidden), rand(hidden, shared)), shared_gate=rand(1, hidden))
    return MoeMlp(spec, MlpSpec(), rand(spec.num_experts, hidden, scale=2.0), experts, SingleDevice(), **extra)


# -- the simulated NPU ---------------------------------------------------------------------

def test_simulated_operators_follow_the_documented_example(sim):
    """npu_moe_init_routing on its documentation's example (3 rows, k = 2),
    the outputs worked out by hand from the documented formula; the gating
    operator's row_idx (j * rows + r); the finalize formula (rows gathered
    back and weighted: weights summing to 1 give x back); the grouped matmul
    per group."""
    x = torch.tensor([[0.1] * 4, [0.2] * 4, [0.3] * 4])
    ids = torch.tensor([[1, 2], [0, 1], [0, 2]], dtype=torch.int32)
    _, _, row_idx = sim.npu_moe_gating_top_k_softmax(torch.randn(3, 3), None, k=2)
    assert row_idx.tolist() == [[0, 3], [1, 4], [2, 5]]
    ex, ex_row, ex_ids = sim.npu_moe_init_routing(x, row_idx, ids, 3)
    assert ex[:, 0].tolist() == pytest.approx([0.2, 0.3, 0.1, 0.2, 0.1, 0.3])
    assert ex_row.tolist() == [2, 0, 1, 4, 3, 5] and ex_ids.tolist() == [0, 0, 1, 1, 2, 2]
    scales = torch.tensor([[0.75, 0.25], [0.5, 0.5], [0.125, 0.875]])
    torch.testing.assert_close(sim.npu_moe_finalize_routing(ex, None, None, None, scales, ex_row, ids), x)
    a, w = torch.randn(5, 4, dtype=torch.bfloat16), [torch.randn(4, 3, dtype=torch.bfloat16) for _ in range(3)]
    y = sim.npu_grouped_matmul([a], w, group_list=torch.tensor([2, 2, 5]), split_item=2, group_type=0)[0]
    want = torch.cat([a[:2].float() @ w[0].float(), a[2:].float() @ w[2].float()]).to(torch.bfloat16)
    assert torch.equal(y, want)
    with pytest.raises(sim.SimulatedNpuError, match="1 to 128 weights"):
        sim.npu_grouped_matmul([a], w * 43, group_list=torch.arange(129), split_item=2, group_type=0)


def npu_ops(sim):
    from paged.backends.npu.layer_ops import NpuLayerOps

    ops = NpuLayerOps(sim)
    assert ops.moe_plan is not None and ops.moe_plan.tensor_group_list, ops.moe_summary
    return ops


@pytest.mark.parametrize("spec,shared", [
    (MoeSpec(8, 3, 24), 0),
    (MoeSpec(8, 2, 24, normalize=False), 40),
    (MoeSpec(8, 2, 24, scoring="sigmoid", normalize=False), 0),
], ids=["softmax-renormalised", "raw-weights-shared-expert", "sigmoid"])
def test_npu_layer_matches_the_torch_loop(sim, spec, shared):
    """One layer, the same rows: the operators' choices are the torch
    route's, the output the torch loop's (bfloat16 rounding apart), with no
    host sync (a release taking the group list as a tensor)."""
    moe = synthetic_moe(spec, dtype=torch.bfloat16, shared=shared)
    ops = npu_ops(sim)
    x = torch.randn(19, 32, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    fused = moe._fused_experts(ops)
    logits = moe_module.router_logits(x, moe.router)
    (w_npu, ids_npu), (w_ref, ids_ref) = fused.route(logits, spec), route(logits, spec)
    assert torch.equal(ids_npu.long(), ids_ref)
    torch.testing.assert_close(w_npu, w_ref)
    before = dict(sim.calls)
    with sim.HostSyncGuard(forbid=True):
        got = moe(x, ops)
    ran = {op for op in ("npu_moe_init_routing", "npu_grouped_matmul", "npu_moe_finalize_routing")
           if sim.calls[op] > before[op]}
    assert len(ran) == 3, ran
    assert (sim.calls["npu_moe_gating_top_k_softmax"] > before["npu_moe_gating_top_k_softmax"]) == (
        spec.scoring == "softmax")  # the gating operator is softmax only: sigmoid scores by torch ops
    want = moe(x, TorchLayerOps())
    torch.testing.assert_close(got.float(), want.float(), atol=0.03, rtol=0.02)


def test_npu_without_the_operators_runs_the_torch_ops(sim, monkeypatch):
    from paged.backends.npu.layer_ops import NpuLayerOps

    monkeypatch.delattr(sim, "npu_moe_init_routing")
    ops = NpuLayerOps(sim)
    assert ops.moe_plan is None
    assert ops.moe_summary == "MoE experts: torch ops (npu_moe_init_routing absent or unreadable)"
    moe = synthetic_moe(MoeSpec(4, 2, 16), dtype=torch.bfloat16)
    x = torch.randn(3, 32).to(torch.bfloat16)
    assert moe._fused_experts(ops) is None and torch.equal(moe(x, ops), moe(x, TorchLayerOps()))


@pytest.fixture(scope="module")
def moe_families(sim, tmp_path_factory):
    """Qwen3-MoE, Mixtral and Qwen2-MoE HF folders loaded in bfloat16."""
    import paged_npu_sim

    from paged.core.models.loaders import load_model_files

    out = {}
    paged_npu_sim.uninstall()  # transformers probes torch_npu when it builds a model: build first
    try:
        for name in ("qwen3moe", "mixtral", "qwen2moe"):
            folder = tmp_path_factory.mktemp(name)
            build(name, folder)
            out[name] = load_model_files(folder / "hf", torch.bfloat16, quiet=True)
    finally:
        assert paged_npu_sim.NpuSimPlatform().is_available().ok
    return out


class ChoiceRecorder:
    """Every layer's expert ids, in call order, from whichever route ran."""

    def __init__(self, monkeypatch):
        from paged.backends.npu.moe import NpuMoeExperts

        self.ids = []
        plain, platform = moe_module.route, NpuMoeExperts.route

        def record(result):
            self.ids.append(result[1].long().tolist())
            return result

        monkeypatch.setattr(moe_module, "route", lambda logits, spec: record(plain(logits, spec)))
        monkeypatch.setattr(NpuMoeExperts, "route", lambda self_, logits, spec: record(platform(self_, logits, spec)))


@pytest.mark.parametrize("name", ["qwen3moe", "mixtral", "qwen2moe"])
def test_npu_model_matches_the_reference_backend(sim, moe_families, name, monkeypatch):
    """A batched prefill and greedy decode in bfloat16: NpuBackend with the
    MoE operators vs the reference backend with the torch loop."""
    import family_models as fm

    from paged.backends.npu.attention import NpuBackend
    from paged.backends.reference.attention import ReferenceBackend
    from paged.core.models import build_model

    monkeypatch.setattr(fm, "BLOCK", 128)  # the NPU's block size
    loaded = moe_families[name]
    c = loaded.config
    g = torch.Generator().manual_seed(1)
    ps = [torch.randint(10, c.vocab_size, (n,), generator=g).tolist() for n in (21, 9)]
    runs, recorder = {}, ChoiceRecorder(monkeypatch)
    for label, cls, ops in (("npu", NpuBackend, npu_ops(sim)), ("reference", ReferenceBackend, TorchLayerOps())):
        recorder.ids = []
        be = cls(c.num_heads, c.num_kv_heads, c.head_dim, 128, torch.bfloat16, "cpu")
        model = build_model(c, loaded.weights, torch.bfloat16, "cpu", be)
        model.ops = ops
        before = sim.calls["npu_grouped_matmul"]
        logits, tokens = greedy_run(model, be, c.num_layers, ps, 3)
        assert (sim.calls["npu_grouped_matmul"] > before) == (label == "npu")
        runs[label] = torch.cat(logits).float(), tokens, recorder.ids
    assert runs["npu"][2] == runs["reference"][2], f"{name}: expert choices differ"
    assert runs["npu"][1] == runs["reference"][1]
    gap = (runs["npu"][0] - runs["reference"][0]).abs().max().item()
    print(f"{name} bf16 simulated NPU MoE operators vs reference torch loop: max |logit diff| {gap:.3f}")
    assert gap < 0.05, gap


# -- CUDA's grouped GEMM ---------------------------------------------------------------------

class GroupedOnCpu(TorchLayerOps):
    """CPU layer ops offering the CUDA glue with a given grouped_mm."""

    def __init__(self, grouped_mm):
        self.grouped_mm = grouped_mm

    def moe_experts(self, gate_up, down, mlp):
        return cuda_moe.GroupedExperts(cuda_moe.stack_in_place(gate_up), cuda_moe.stack_in_place(down), mlp, self,
                                       self.grouped_mm)


GROUPED = {"loop": cuda_moe.loop_grouped_mm, "torch": cuda_moe.torch_grouped_mm()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("which", list(GROUPED))
def test_grouped_glue_matches_the_torch_loop(which, dtype):
    """Through the seam (``ops.moe_experts``): 1, 6 and 37 rows over 10
    experts (some chosen by none: empty groups), a shared expert, raw
    weights; the same output as the torch-op path over the same experts."""
    if GROUPED[which] is None:
        pytest.skip(f"torch {torch.__version__} has no grouped_mm")
    spec = MoeSpec(10, 3, 24, normalize=False)
    moe = synthetic_moe(spec, dtype=dtype, shared=16)
    ops = GroupedOnCpu(GROUPED[which])
    g = torch.Generator().manual_seed(2)
    for rows in (1, 6, 37):
        x = torch.randn(rows, 32, generator=g).to(dtype)
        want = moe(x, TorchLayerOps())
        try:
            got = moe(x, ops)
        except RuntimeError as e:  # this torch's CPU grouped_mm lacks the dtype
            pytest.skip(f"torch.grouped_mm on the CPU in {dtype}: {e}")
        assert moe._fused_experts(ops) is not None
        tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=0.02, rtol=0.02)
        torch.testing.assert_close(got, want, **tol, msg=f"{rows} rows")


def test_grouped_glue_handles_empty_groups_and_slot_order():
    """Rows choosing only experts 7 and 2 (every other group empty), in an
    order that is not sorted: each row gets exactly its own experts' sum."""
    spec = MoeSpec(8, 2, 16)
    moe = synthetic_moe(spec)
    experts = cuda_moe.GroupedExperts(torch.stack(moe.gate_up), torch.stack(moe.down), moe.mlp, TorchLayerOps(),
                                      cuda_moe.loop_grouped_mm)
    x = torch.randn(3, 32)
    ids = torch.tensor([[7, 2], [2, 7], [7, 2]])
    weights = torch.tensor([[0.9, 0.1], [0.6, 0.4], [0.5, 0.5]])
    got, runs = experts(x, ids, weights)

    def expert(e, row):
        h = torch.nn.functional.linear(row, moe.gate_up[e])
        return torch.nn.functional.linear(torch.nn.functional.silu(h[:16]) * h[16:], moe.down[e])

    want = torch.stack([sum(w * expert(e, x[r]) for e, w in zip(ids[r].tolist(), weights[r])) for r in range(3)])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert runs is None


def test_stacking_keeps_one_copy_of_the_experts():
    mats = [torch.randn(6, 4) for _ in range(3)]
    values = [m.clone() for m in mats]
    stacked = cuda_moe.stack_in_place(mats)
    assert all(m.untyped_storage().data_ptr() == stacked.untyped_storage().data_ptr() for m in mats)
    assert all(torch.equal(m, v) for m, v in zip(mats, values))


def test_cuda_layer_ops_refuse_cpu_tensors_in_one_line():
    """The CUDA seam on CPU tensors declines (the torch-op path runs) and
    says why."""
    moe = synthetic_moe(MoeSpec(4, 2, 16), dtype=torch.bfloat16)
    why = cuda_moe.refusal(moe.gate_up, moe.down, cuda_moe.torch_grouped_mm() or cuda_moe.loop_grouped_mm)
    assert why == "device cpu (grouped_mm needs CUDA compute capability >= 8.0)"
    assert moe._fused_experts(CudaLayerOps()) is None
    assert cuda_moe.refusal(moe.gate_up, moe.down, None).startswith("torch ")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here: torch's grouped_mm on a GPU not run")
def test_grouped_mm_on_the_gpu_matches_the_loop():
    """The real grouped GEMM on a GPU (bfloat16): chosen by the CUDA layer
    ops, the same output as the torch-op path on the device."""
    if torch.cuda.get_device_capability() < cuda_moe.MIN_CAPABILITY:
        pytest.skip("grouped_mm needs compute capability >= 8.0")
    spec = MoeSpec(16, 4, 64)
    moe = synthetic_moe(spec, hidden=128, dtype=torch.bfloat16, shared=32)
    moe.router = moe.router.cuda()
    moe.gate_up = [w.cuda() for w in moe.gate_up]
    moe.down = [w.cuda() for w in moe.down]
    moe.shared = tuple(w.cuda() for w in moe.shared)
    moe.shared_gate = moe.shared_gate.cuda()
    x = torch.randn(45, 128, device="cuda").to(torch.bfloat16)
    want = moe(x, TorchLayerOps())
    ops = CudaLayerOps()
    got = moe(x, ops)
    assert isinstance(moe._fused_experts(ops), cuda_moe.GroupedExperts)
    torch.testing.assert_close(got.float(), want.float(), atol=0.03, rtol=0.02)
