"""A mixture-of-experts layer's experts (core/models/moe.py) through
torch_npu's MoE operators, where the installed release offers them; the
torch-op path otherwise (``moe_plan`` says why).

One step, every tensor on the device (no host transfer with a release whose
grouped matmul takes its group list as a tensor):

1. ``npu_moe_gating_top_k_softmax``: softmax over the router logits (given
   in float32, as HF scores them) and the top k, renormalised here where
   the family says; sigmoid scoring (no such operator for a family without
   grouped routing) stays torch's ``route``;
2. ``npu_moe_init_routing``: the (row, choice) slots sorted by expert,
   stably, x's rows gathered in that order; each expert's end in the
   sorted slots is a ``searchsorted`` over the sorted expert ids;
3. ``npu_grouped_matmul`` for the gate/up projections of every expert at
   once (one x split along M by the group list, one [K, N] weight per
   expert: the dense [N, K] matrix transposed, a view), the layer ops'
   activation, then the down projections the same way;
4. ``npu_moe_finalize_routing``: each row's weighted sum of its choices.

v1 of the routing operator is used because its documented index
convention (``row_idx[r, j] = j * rows + r``) is the one the finalize
formula reads; ``npu_moe_init_routing_v2`` drops row_idx and its documented
formulas disagree on how a sorted slot maps back to x's row.

Checked on the simulator only (tests/npu_sim, tests/test_moe_accelerators.py):
never run on an NPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from paged.backends.npu.operators import operator_keywords
from paged.core.models.layers import mlp_activation
from paged.core.models.moe import route

GATING = "npu_moe_gating_top_k_softmax"
ROUTING = "npu_moe_init_routing"
GROUPED = "npu_grouped_matmul"
FINALIZE = "npu_moe_finalize_routing"
#: npu_grouped_matmul takes at most this many weights (one per expert)
MAX_EXPERTS = 128
DTYPES = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class MoePlan:
    """How the installed release's MoE operators are called."""

    tensor_group_list: bool  # group_list a device tensor (group_type / group_list_type); else a host list

    def describe(self) -> str:
        how = "group_list tensor" if self.tensor_group_list else "group_list host list (a sync per projection)"
        return f"MoE experts: {GATING}, {ROUTING}, {GROUPED} ({how}), {FINALIZE}"


def moe_plan(module) -> tuple[MoePlan | None, str]:
    """(the plan, its start-up line), or (None, why the torch-op experts run)."""
    keywords = {name: operator_keywords(module, name)[0] for name in (GATING, ROUTING, GROUPED, FINALIZE)}
    missing = [name for name, kw in keywords.items() if kw is None]
    if missing:
        return None, f"MoE experts: torch ops ({', '.join(missing)} absent or unreadable)"
    if "drop_pad_mode" not in keywords[FINALIZE]:  # the releases whose skip/bias terms are optional
        return None, f"MoE experts: torch ops ({FINALIZE} without optional skip/bias terms)"
    if not {"group_list", "split_item"} <= keywords[GROUPED]:
        return None, f"MoE experts: torch ops ({GROUPED} without group_list / split_item)"
    plan = MoePlan({"group_type", "group_list_type"} <= keywords[GROUPED])
    return plan, plan.describe()


def refusal(gate_up: list, down: list) -> str | None:
    """Why these experts cannot take the operators (None: they can)."""
    if len(gate_up) > MAX_EXPERTS:
        return f"{len(gate_up)} experts (npu_grouped_matmul takes at most {MAX_EXPERTS} weights)"
    matrices = list(gate_up) + list(down)
    if not all(isinstance(w, torch.Tensor) for w in matrices):
        return "packed expert matrices (the grouped matmul takes dense ones)"
    if len({(w.dtype, w.device) for w in matrices}) != 1 or matrices[0].dtype not in DTYPES:
        return f"expert matrices of {sorted({str(w.dtype) for w in matrices})} (expected one of float16, bfloat16)"
    return None


class NpuMoeExperts:
    """``route(logits, spec)`` and ``(x, ids, weights) -> (out, None)`` over
    one layer's dense experts through torch_npu's operators."""

    dtypes = DTYPES

    def __init__(self, npu, plan: MoePlan, gate_up: list, down: list, mlp, ops):
        self.npu, self.plan, self.mlp, self.ops = npu, plan, mlp, ops
        self.gate_up = [w.t() for w in gate_up]  # [K, N] views of the [N, K] matrices
        self.down = [w.t() for w in down]

    def route(self, logits: torch.Tensor, spec) -> tuple[torch.Tensor, torch.Tensor]:
        if spec.scoring != "softmax":
            return route(logits, spec)
        weights, ids, _ = self.npu.npu_moe_gating_top_k_softmax(logits.float(), None, k=spec.top_k)
        if spec.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, None]:
        rows, k = ids.shape
        ids = ids.to(torch.int32)
        row_idx = torch.arange(rows * k, dtype=torch.int32, device=x.device).view(k, rows).t().contiguous()
        sorted_x, sorted_to_slot, sorted_ids = self.npu.npu_moe_init_routing(x.contiguous(), row_idx, ids, rows)
        experts = torch.arange(len(self.gate_up), dtype=sorted_ids.dtype, device=x.device)
        ends = torch.searchsorted(sorted_ids, experts, right=True).to(torch.int64)
        gate_up = self._grouped(sorted_x, self.gate_up, ends)
        act = mlp_activation(self.ops, gate_up, self.mlp).contiguous()
        ys = self._grouped(act, self.down, ends)
        out = self.npu.npu_moe_finalize_routing(ys, None, None, None, weights.to(ys.dtype), sorted_to_slot, ids,
                                                drop_pad_mode=0)
        return out, None

    def _grouped(self, a: torch.Tensor, weights: list, ends: torch.Tensor) -> torch.Tensor:
        if self.plan.tensor_group_list:
            return self.npu.npu_grouped_matmul([a], weights, group_list=ends, split_item=2, group_type=0,
                                               group_list_type=0)[0]
        return self.npu.npu_grouped_matmul([a], weights, group_list=ends.tolist(), split_item=2)[0]


def npu_moe_experts(npu, plan: MoePlan | None, gate_up: list, down: list, mlp, ops) -> NpuMoeExperts | None:
    """The operator path for these experts, or None (the torch-op path)."""
    if plan is None or refusal(gate_up, down) is not None:
        return None
    return NpuMoeExperts(npu, plan, gate_up, down, mlp, ops)
