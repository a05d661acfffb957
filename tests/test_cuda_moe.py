"""CUDA's mixture-of-experts glue (backends/cuda/moe.py): torch's grouped
GEMM over stacked experts. On CPU tensors: the glue (sorting, offsets,
empty groups, slot order, the choice-order sum) with the loop of matmuls
that has grouped_mm's contract and with torch's own grouped_mm where this
torch runs it on the CPU, against the torch-op path (core/models/moe.py)
over the same experts, through the same seam (``ops.moe_experts``). The
real call on a GPU runs in .ci/gpu_check.sh and skips here without one.
No transformers needed: the layers are random dense experts.
"""

from __future__ import annotations

import pytest
import torch

from paged.backends.cuda import moe as cuda_moe
from paged.backends.cuda.layer_ops import CudaLayerOps
from paged.core.models.layers import SingleDevice, TorchLayerOps
from paged.core.models.moe import MoeMlp
from paged.core.models.spec import MlpSpec, MoeSpec


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
        except (RuntimeError, NotImplementedError) as e:  # this torch's CPU grouped_mm lacks the dtype
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


def test_grouped_glue_reads_nothing_on_the_host():
    """The whole step on torch's ``meta`` device (no data to read: a host
    read would raise), as a CUDA graph would capture it."""
    grouped_mm = cuda_moe.torch_grouped_mm()
    if grouped_mm is None:
        pytest.skip(f"torch {torch.__version__} has no grouped_mm")
    meta = dict(device="meta", dtype=torch.bfloat16)
    experts = cuda_moe.GroupedExperts(torch.empty(6, 32, 32, **meta), torch.empty(6, 32, 16, **meta), MlpSpec(),
                                      TorchLayerOps(), grouped_mm)
    out, runs = experts(torch.empty(5, 32, **meta), torch.empty(5, 2, device="meta", dtype=torch.int64),
                        torch.empty(5, 2, device="meta"))
    assert out.shape == (5, 32) and out.device.type == "meta" and runs is None


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
