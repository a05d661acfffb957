"""The NPU's mixture-of-experts glue (backends/npu/moe.py): torch_npu's MoE
operators on the SIMULATOR (tests/npu_sim: each operator written from its
documented formula, on CPU tensors; not an NPU run).

- the simulated operators against the documentation's own example, worked
  by hand from the documented formulas;
- one layer (random dense experts) through the operators against the torch
  loop (core/models/moe.py): the same choices, close outputs, no host sync;
  sigmoid scoring (by torch ops: the gating operator is softmax only), raw
  (not renormalised) weights and the gated shared expert honoured;
- tiny Qwen3-MoE, Mixtral and Qwen2-MoE models (tests/moe_models.py) in
  bfloat16 through NpuBackend and the operators against the reference
  backend's torch loop over experts (the oracle): the same expert choices
  at every layer, greedy tokens equal, logits close;
- a release without the operators runs the torch-op path and says which
  are missing.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from family_models import greedy_run  # noqa: E402
from moe_models import build  # noqa: E402
from test_cuda_moe import synthetic_moe  # noqa: E402
from test_npu_sim import sim  # noqa: E402,F401  (the simulator fixture)

from paged.core.models import moe as moe_module  # noqa: E402
from paged.core.models.layers import TorchLayerOps  # noqa: E402
from paged.core.models.moe import route  # noqa: E402
from paged.core.models.spec import MoeSpec  # noqa: E402


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


def test_moe_plan_follows_the_release_keywords():
    """A grouped matmul without group_type / group_list_type takes a host
    list (a sync, said in the start-up line); a finalize operator whose skip
    and bias terms are not optional (no drop_pad_mode) is not used."""
    import types

    from paged.backends.npu.moe import moe_plan

    def gating(x, finished=None, k=1): ...
    def routing(x, row_idx, expert_idx, active_num): ...
    def grouped_old(x, weight, *, bias=None, group_list=None, split_item=0): ...
    def finalize(expanded_permuted_rows, skip1, skip2, bias, scales, expanded_src_to_dst_row,
                 export_for_source_row, drop_pad_mode=0): ...
    def finalize_old(expanded_permuted_rows, skip1, skip2, bias, scales, expanded_src_to_dst_row,
                     export_for_source_row): ...

    module = types.SimpleNamespace(npu_moe_gating_top_k_softmax=gating, npu_moe_init_routing=routing,
                                   npu_grouped_matmul=grouped_old, npu_moe_finalize_routing=finalize)
    plan, line = moe_plan(module)
    assert plan is not None and not plan.tensor_group_list and "host list" in line
    module.npu_moe_finalize_routing = finalize_old
    assert moe_plan(module) == (None, "MoE experts: torch ops (npu_moe_finalize_routing without optional "
                                      "skip/bias terms)")


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
