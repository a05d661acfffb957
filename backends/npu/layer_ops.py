"""The NPU's layer ops: torch's elementwise ops (core/models/layers.
TorchLayerOps) plus a mixture-of-experts layer's experts through torch_npu's
MoE operators where the installed release has them (moe.py)."""

from __future__ import annotations

from paged.backends.npu.moe import moe_plan, npu_moe_experts
from paged.core.models.layers import TorchLayerOps


class NpuLayerOps(TorchLayerOps):
    name = "npu"

    def __init__(self, npu):
        self.npu = npu  # torch_npu, or the simulator in its place
        self.moe_plan, self.moe_summary = moe_plan(npu)

    def moe_experts(self, gate_up, down, mlp):
        return npu_moe_experts(self.npu, self.moe_plan, gate_up, down, mlp, self)
