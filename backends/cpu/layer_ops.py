"""The elementwise ops of a decoder layer as single C++ passes of
paged._C_cpu (csrc_cpu/ops): the CPU worker hands them to the model in place
of the torch ops (same interface, core/models/layers.TorchLayerOps)."""

from __future__ import annotations

import os

import torch
from torch.utils.dlpack import to_dlpack

from paged.backends.cpu.attention import ops as compiled_ops
from paged.core.models.layers import TorchLayerOps

__all__ = ["CpuFusedLayerOps", "fused_layer_ops"]


class CpuFusedLayerOps(TorchLayerOps):
    """The same ops as single C++ passes (paged._C_cpu, csrc_cpu/ops) on CPU
    tensors of float32 / bfloat16. ``add_rms_norm``, the Q/K norms and the
    rotation work in place (x becomes the normed rows, residual the sum; qkv
    is normed and rotated). The rotation takes the table's width as the
    rotary dimension (a partial-rotary table rotates each head's leading
    dims). LayerNorm and an ungated MLP's activation stay torch's (no
    family has them).

    Tensors cross as DLPack capsules (``to_dlpack``): handing nanobind the
    tensor itself goes through torch's Python-level ``__dlpack__`` and costs
    ~8 us per tensor, more than the kernels at decode sizes. The C++ side
    checks the capsules' dtype, shape and contiguity as usual.
    """

    name = "cpu-fused"

    def __init__(self, ops_module):
        self._C = ops_module

    def rms_norm(self, x, weight, eps):
        out = torch.empty_like(x)
        self._C.rms_norm(to_dlpack(out), to_dlpack(x), to_dlpack(weight), eps)
        return out

    def add_rms_norm(self, x, residual, weight, eps):
        self._C.fused_add_rms_norm(to_dlpack(x), to_dlpack(residual), to_dlpack(weight), eps)
        return x, residual

    def silu_and_mul(self, gate_up):
        out = torch.empty(gate_up.shape[0], gate_up.shape[1] // 2, dtype=gate_up.dtype)
        self._C.silu_and_mul(to_dlpack(out), to_dlpack(gate_up))
        return out

    def moe_experts(self, gate_up, down, mlp):
        """One extension call per mixture-of-experts layer for these experts
        (backends/cpu/moe_experts.py), or None where it does not apply."""
        from paged.backends.cpu.moe_experts import cpu_moe_experts

        return cpu_moe_experts(gate_up, down, mlp)

    def moe_route(self, x, router, spec):
        """(weights float32 [T, k], ids int64 [T, k]) of a mixture-of-experts
        layer in one C++ pass (router logits, scores, top-k; csrc_cpu/ops,
        ``moe_route``), or None where the router is not a float32 tensor
        (a packed router: core/models/moe.py's path). Every CPU path takes
        it (Python layers, the C++ layer stack's MoeExperts.forward, each
        tensor-parallel rank), so they choose the same experts bit for bit."""
        if not (isinstance(router, torch.Tensor) and router.dtype == torch.float32 and x.dtype == torch.float32):
            return None
        rows = x.shape[0]
        weights = torch.empty(rows, spec.top_k, dtype=torch.float32)
        ids = torch.empty(rows, spec.top_k, dtype=torch.int64)
        self._C.moe_route(to_dlpack(x.contiguous()), to_dlpack(router.contiguous()), spec.top_k, spec.scoring,
                          spec.normalize, to_dlpack(weights), to_dlpack(ids))
        return weights, ids

    def gelu_tanh_and_mul(self, gate_up):
        out = torch.empty(gate_up.shape[0], gate_up.shape[1] // 2, dtype=gate_up.dtype)
        self._C.gelu_tanh_and_mul(to_dlpack(out), to_dlpack(gate_up))
        return out

    def qk_norm(self, qkv, q_weight, k_weight, num_heads, num_kv_heads, head_dim, eps):
        self._C.qk_rms_norm(to_dlpack(qkv), to_dlpack(q_weight), to_dlpack(k_weight), num_heads, num_kv_heads,
                            head_dim, eps)
        return qkv

    def rope_inputs(self, rope, positions):
        return positions.to(torch.int64).contiguous(), rope.cos_sin_cache

    def rope_split_qkv(self, qkv, rope, rope_in, num_heads, num_kv_heads, head_dim):
        positions, cos_sin = rope_in
        self._C.rotary_embedding(to_dlpack(positions), to_dlpack(qkv), to_dlpack(cos_sin),
                                 num_heads, num_kv_heads, head_dim)
        t = qkv.shape[0]
        q = torch.empty(t, num_heads, head_dim, dtype=qkv.dtype)
        k = torch.empty(t, num_kv_heads, head_dim, dtype=qkv.dtype)
        v = torch.empty_like(k)
        self._C.split_qkv(to_dlpack(qkv), to_dlpack(q), to_dlpack(k), to_dlpack(v))
        return q, k, v


def fused_layer_ops(dtype: torch.dtype) -> CpuFusedLayerOps | None:
    """The fused ops where they apply (float32 / bfloat16 and a built
    extension; ``PAGED_FUSED_OPS=0`` turns them off), else None."""
    if dtype not in (torch.float32, torch.bfloat16) or os.environ.get("PAGED_FUSED_OPS", "1") == "0":
        return None
    try:
        module = compiled_ops()
    except ImportError:
        return None
    return CpuFusedLayerOps(module) if hasattr(module, "qk_rms_norm") else None
