"""The CUDA layer ops: torch's elementwise ops (core/models/layers.
TorchLayerOps) plus a mixture-of-experts layer's experts as torch's grouped
GEMM where it applies (moe.py)."""

from __future__ import annotations

from paged.backends.cuda.moe import cuda_moe_experts
from paged.core.models.layers import TorchLayerOps


class CudaLayerOps(TorchLayerOps):
    name = "cuda"

    def moe_experts(self, gate_up, down, mlp):
        return cuda_moe_experts(gate_up, down, mlp, self)
