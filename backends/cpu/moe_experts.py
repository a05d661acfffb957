"""One mixture-of-experts layer's chosen experts in one extension call
(paged._C_cpu.MoeExperts, csrc_cpu/model/moe_experts.h): what
core/models/moe.py runs on one CPU device when every expert is a packed
matrix on a batch-invariant int8 path. The grouping, the kernels and the
summation order are the Python path's, so the bits are too
(tests/test_moe.py); it saves the per-expert Python calls (2 x top-k
linears per layer at batch 1). Each expert matrix is read from its
persistent weight panels where the worker planned them (the routed experts
are most of a mixture's bytes; docs/weight-panels.md)."""

from __future__ import annotations

import torch

from paged.backends.cpu.attention import dl
from paged.backends.cpu.quant_linear import HALF_LAYOUTS, CpuPackedLinear

#: the packed linear settings the C++ call runs as CpuPackedLinear does
#: ("float32" takes a dense GEMM from DENSE_ROWS rows, "mixed-bf16" its
#: prompt rows on AMX tiles: those stay on the Python path)
FUSED_ACTIVATIONS = ("int8", "int8x2", "mixed")


class CpuMoeExperts:
    """``(x, ids, weights) -> (out, experts run)`` over one layer's experts."""

    def __init__(self, gate_up: list, down: list):
        self._experts = (gate_up, down)
        self._native = _native_experts(gate_up, down)
        self._made = [self._native]  # every native object made: a layer stack may hold an earlier one

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, int]:
        if not self._native.panels_match_build:  # the linear build changed (tests, benchmarks): its panels, or none
            self._native = _native_experts(*self._experts)
            self._made.append(self._native)
        x = x.contiguous()
        out = torch.empty_like(x)
        runs = self._native.run(dl(x), dl(ids.contiguous()), dl(weights.contiguous()), dl(out))
        return out, runs

    def for_stack(self, router, spec, shared: tuple | None = None, shared_gate=None):
        """The native experts with the layer's router set (MoeExperts.set_router)
        and its shared expert and gate (set_shared), for the C++ layer stack's
        add_layer(moe=...), which then routes and runs them itself while they
        match the linear build; None for a router or gate that is not a
        float32 tensor, or a shared expert the one call cannot take (the
        stack calls the Python MLP)."""
        dense = [w for w in (router, shared_gate) if w is not None]
        if not all(isinstance(w, torch.Tensor) and w.dtype == torch.float32 for w in dense):
            return None
        if shared is not None and not _one_call_setting([self._experts[0][0], *shared]):
            return None
        self._native.set_router(dl(router.contiguous()), spec.top_k, spec.scoring, spec.normalize)
        if shared is not None:
            (g, gp), (d, dp) = (_matrix(w) for w in shared)
            self._native.set_shared(g, d, gp, dp, None if shared_gate is None else dl(shared_gate.contiguous()))
        return self._native

    @property
    def stack_runs(self) -> int:
        """Experts run by layer stacks' calls (MoeMlp.expert_runs adds them)."""
        return sum(n.stack_runs for n in self._made)


def _native_experts(gate_up: list, down: list):
    """The C++ experts over each matrix's persistent weight panels for the
    active linear build (the packed arrays' stand-ins beside them), or its
    packed arrays where it has none."""
    from paged import _C_cpu

    first = gate_up[0]
    native = _C_cpu.MoeExperts(first.in_features, first.out_features // 2, first.activations, first.one_term)
    for g, d in zip(gate_up, down):
        (gm, gp), (dm, dp) = _matrix(g), _matrix(d)
        native.add_expert(gm, dm, gp, dp)
    return native


def _matrix(w: CpuPackedLinear) -> tuple:
    """((qtype, qs, d, m), panels or None) of a packed matrix as MoeExperts takes it."""
    panels = w.weight_panels()
    qs, d, m = w.kernel_arrays(panels)
    return (w.kernel_qtype, dl(qs), dl(d), None if m is None else dl(m)), None if panels is None else dl(panels)


def cpu_moe_experts(gate_up: list, down: list, mlp) -> CpuMoeExperts | None:
    """The one-call experts for a SiLU-gated layer whose matrices are all
    packed with one supported setting, else None (the Python path)."""
    try:
        from paged import _C_cpu
    except ImportError:
        return None
    if not hasattr(_C_cpu, "MoeExperts") or not mlp.gated or mlp.activation != "silu" or not gate_up:
        return None
    if not _one_call_setting(list(gate_up) + list(down)):
        return None
    return CpuMoeExperts(list(gate_up), list(down))


def _one_call_setting(matrices: list) -> bool:
    """Whether the matrices are packed one way the C++ call runs: no f16 /
    bf16 (half_linear, in Python) or row parts (their parts' calls), and one
    supported activations setting (and one_term) for all."""
    if not all(isinstance(w, CpuPackedLinear) and w.qtype not in HALF_LAYOUTS and not w.parts for w in matrices):
        return False
    first = matrices[0]
    return first.activations in FUSED_ACTIVATIONS and all(
        (w.activations, w.one_term) == (first.activations, first.one_term) for w in matrices)
