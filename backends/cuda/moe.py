"""A mixture-of-experts layer's experts (core/models/moe.py) as one grouped
GEMM per projection: torch's ``grouped_mm`` (torch.nn.functional.grouped_mm,
torch._grouped_mm before it is public) over the experts stacked into one
[E, N, K] tensor, every step on the device (no host transfer, unlike the
torch-op path's host grouping).

The glue (``GroupedExperts``): the (row, choice) slots sorted by expert,
stably (a row's slots keep row order within an expert, as the torch-op
path groups them), x's rows gathered in that order, each expert's end in
the sorted slots as int32 offsets (an expert no row chose: an empty group,
no padding), gate/up of every expert in one call, the layer ops'
activation, down in one call, the outputs put back in slot order and each
row's choices summed in choice order (``combine_choices``, the torch-op
path's sum).

torch documents ``grouped_mm`` for bfloat16 on CUDA devices of compute
capability 8.0 and up; its kernels want 16-byte aligned rows (K and N
multiples of 8 for bfloat16). Elsewhere, or where a probe call raises,
the torch-op path runs. ``loop_grouped_mm`` is the same contract as a loop
of matmuls: what the glue is tested with on CPU tensors
(tests/test_moe_accelerators.py), beside torch's own grouped_mm where the
installed torch runs it on the CPU.
"""

from __future__ import annotations

import logging

import torch

from paged.core.models.layers import mlp_activation
from paged.core.models.moe import combine_choices

log = logging.getLogger("paged.engine")

#: what torch documents grouped_mm for on CUDA
DTYPES = (torch.bfloat16,)
MIN_CAPABILITY = (8, 0)
ALIGN = 8  # elements of bfloat16 in 16 bytes


def torch_grouped_mm():
    """torch's grouped GEMM, or None where this torch has none."""
    return getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def loop_grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """grouped_mm's 2-D x 3-D case as a loop: rows offs[g - 1]:offs[g] of
    ``a`` [M, K] times ``b[g]`` [K, N] (a host read of the offsets)."""
    out = a.new_zeros(a.shape[0], b.shape[-1])
    start = 0
    for g, end in enumerate(offs.tolist()):
        if end > start:
            out[start:end] = a[start:end] @ b[g]
        start = end
    return out


class GroupedExperts:
    """``(x, ids, weights) -> (out, None)`` over one layer's experts held as
    stacked gate/up [E, 2I, H] and down [E, H, I] tensors, through
    ``grouped_mm(a, b, offs=...)``."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, mlp, ops, grouped_mm):
        self.gate_up_t = gate_up.transpose(1, 2)  # [E, H, 2I]: the column-major operand the kernels take
        self.down_t = down.transpose(1, 2)
        self.mlp, self.ops, self.grouped_mm = mlp, ops, grouped_mm
        self.dtypes = (gate_up.dtype,)

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, None]:
        k = ids.shape[1]
        sorted_ids, order = torch.sort(ids.reshape(-1), stable=True)
        # each expert's end in the sorted slots (bincount would read its maximum on the host)
        experts = torch.arange(self.gate_up_t.shape[0], dtype=sorted_ids.dtype, device=ids.device)
        offs = torch.searchsorted(sorted_ids, experts, right=True).to(torch.int32)
        xs = x.index_select(0, order // k)
        act = mlp_activation(self.ops, self.grouped_mm(xs, self.gate_up_t, offs=offs), self.mlp)
        ys = self.grouped_mm(act.contiguous(), self.down_t, offs=offs)
        ys = torch.empty_like(ys).index_copy_(0, order, ys)  # back to slot order
        return combine_choices(ys, weights, k), None


def refusal(gate_up: list, down: list, grouped_mm) -> str | None:
    """Why these experts cannot take torch's grouped GEMM on CUDA (None: they can)."""
    if grouped_mm is None:
        return f"torch {torch.__version__} has no grouped_mm"
    matrices = list(gate_up) + list(down)
    if not all(isinstance(w, torch.Tensor) for w in matrices):
        return "packed expert matrices (grouped_mm takes dense ones)"
    first = matrices[0]
    if any((w.dtype, w.device) != (first.dtype, first.device) for w in matrices) or first.dtype not in DTYPES:
        return f"expert matrices of {first.dtype} (grouped_mm is documented for bfloat16)"
    if first.device.type != "cuda" or torch.cuda.get_device_capability(first.device) < MIN_CAPABILITY:
        return f"device {first.device} (grouped_mm needs CUDA compute capability >= 8.0)"
    if any(n % ALIGN for n in (*gate_up[0].shape, *down[0].shape)):
        return f"expert shapes {tuple(gate_up[0].shape)} / {tuple(down[0].shape)} not multiples of {ALIGN}"
    return None


def stack_in_place(matrices: list) -> torch.Tensor:
    """The matrices stacked into one tensor; the list then holds views of it
    (the separate tensors freed: expert weights are not held twice)."""
    stacked = torch.stack(matrices)
    matrices[:] = list(stacked.unbind(0))
    return stacked


def cuda_moe_experts(gate_up: list, down: list, mlp, ops) -> GroupedExperts | None:
    """The grouped-GEMM experts where they apply (one probe call on the
    device first), else None: the torch-op path."""
    grouped_mm = torch_grouped_mm()
    why = refusal(gate_up, down, grouped_mm)
    if why is None:
        experts = GroupedExperts(stack_in_place(gate_up), stack_in_place(down), mlp, ops, grouped_mm)
        x = torch.zeros(1, gate_up[0].shape[1], dtype=gate_up[0].dtype, device=gate_up[0].device)
        try:
            experts(x, torch.zeros(1, 1, dtype=torch.int64, device=x.device), torch.ones(1, 1, device=x.device))
            return experts
        except (RuntimeError, NotImplementedError) as e:  # an architecture or build this torch's kernels do not cover
            why = f"grouped_mm raised {str(e).splitlines()[0]}"
    log.info("MoE experts: the torch-op path (%s)", why)
    return None
