"""The mixture-of-experts MLP (core/models/spec.py MoeSpec) as torch ops:
what every platform runs (the reference backend's oracle, the CPU's packed
experts, CUDA and NPU through the same ops).

One step, grouped by expert so each expert's weights are read once per step
(not once per row that chose it):

1. the router scores every row (``router_logits``: one product per row, so
   a row's expert choice does not depend on its batch), ``route`` picks the
   top-k experts and their weights (on the CPU one C++ pass does both on
   every path, ``ops.moe_route``: ``MoeMlp.route_rows``);
2. the (row, k-th choice) slots are grouped by expert on the host (one
   transfer of the choices per layer; a row's slots keep row order within
   an expert, generating rows first); each expert gathers its rows (batch
   1: the row itself) and runs its gate/up projection (one ``linear`` call
   per expert), then one activation pass runs over every expert's rows;
3. every expert's activations are gathered across tensor-parallel ranks at
   once, each expert's down projection runs on its rows, and the output
   rows are gathered at once (two gathers per layer, as a dense MLP);
4. the outputs are put back in slot order (batch 1: already there) and
   each row sums its k weighted outputs in its choice order (first choice
   first), the same order whichever other rows chose the same experts:
   with row-invariant linears (the CPU's packed int8 paths) a row's bits do
   not depend on its batch.

Steps 2-4 are torch ops over the platform's linears (``_grouped``), or one
call where the layer ops offer it (``ops.moe_experts``, on one device): the
CPU's packed int8 experts (csrc_cpu/model/moe_experts.h, with the same
grouping, kernels and summation order, so the same bits), CUDA's grouped
GEMM over stacked dense experts (backends/cuda/moe.py), torch_npu's MoE
routing operators and grouped matmul (backends/npu/moe.py, which also
brings step 1's gating operator). Those two keep every step on the device
(no host transfer) and do not count ``expert_runs``.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from paged.core.models import elementwise
from paged.core.models.layers import SingleDevice, linear, mlp_activation
from paged.core.models.spec import MlpSpec, MoeSpec


#: the shared expert's sigmoid gate as a one-expert routing (ops.moe_route's spec)
SHARED_GATE = SimpleNamespace(top_k=1, scoring="sigmoid", normalize=False)


def _platform_rows(ops, x: torch.Tensor, weight, spec):
    """The layer ops' routing of x by weight (``ops.moe_route``), or None
    where they have none or decline this weight."""
    moe_route = getattr(ops, "moe_route", None)
    return moe_route(x, weight, spec) if moe_route else None


def router_logits(x: torch.Tensor, weight) -> torch.Tensor:
    """x [T, H] @ weight[E, H].T. A dense router multiplies each row on its
    own (a batched matrix-vector product): dense GEMM kernels sum in an
    order that depends on the number of rows, and one ulp there may pick
    another expert for a row beside other rows. A packed router brings its
    own (row-invariant) linear."""
    if not isinstance(weight, torch.Tensor):
        return linear(x, weight)
    return torch.bmm(x.unsqueeze(1), weight.t().unsqueeze(0).expand(x.shape[0], -1, -1)).squeeze(1)


def route(logits: torch.Tensor, spec: MoeSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights float32 [T, k], expert ids int64
    [T, k]), best first: scores by softmax over every expert (in float32, as
    HF does) or by each logit's sigmoid, the top k, renormalised to sum to 1
    where the family does."""
    logits = logits.float()
    scores = torch.softmax(logits, dim=-1) if spec.scoring == "softmax" else elementwise.sigmoid(logits)
    weights, ids = torch.topk(scores, spec.top_k, dim=-1)
    if spec.normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class MoeMlp:
    """One layer's experts: ``router`` [E, H] (dense or packed), per expert
    its fused gate/up rows and down matrix (dense tensors or a platform's
    packed weights), an optional shared expert (gate_up, down) and its
    sigmoid gate [1, H]; ``parallel`` is the model's SingleDevice or
    TensorParallelOps (a rank holds every expert's slice of the
    intermediate size and its down rows' slice of the hidden size)."""

    def __init__(self, spec: MoeSpec, mlp: MlpSpec, router, experts: list[tuple[object, object]], parallel,
                 shared: tuple[object, object] | None = None, shared_gate: torch.Tensor | None = None):
        if len(experts) != spec.num_experts:
            raise ValueError(f"moe experts: expected {spec.num_experts}, got {len(experts)}")
        self.spec, self.mlp, self.router, self.parallel = spec, mlp, router, parallel
        self.gate_up = [g for g, _ in experts]
        self.down = [d for _, d in experts]
        self.shared, self.shared_gate = shared, shared_gate
        self._runs = 0  # expert MLPs run by this object's calls (expert_runs)
        self._fused, self._fused_ops = None, None  # the platform's one-call experts for the layer ops last seen

    def matrices(self) -> list[tuple[str, object]]:
        """(kind, matrix) of every expert and shared-expert matrix."""
        out = [(kind, w) for g, d in zip(self.gate_up, self.down) for kind, w in (("gate_up", g), ("down", d))]
        if self.shared is not None:
            out += [("gate_up", self.shared[0]), ("down", self.shared[1])]
        return out

    def __call__(self, x: torch.Tensor, ops, first_prompt_row: int | None = None) -> torch.Tensor:
        fused = self._fused_experts(ops)
        if fused is not None and x.dtype not in getattr(fused, "dtypes", (torch.float32,)):
            fused = None
        weights, ids = self.route_rows(x, ops, fused)
        if fused is not None:  # steps 2-4 in one platform call (the CPU's: the same bits)
            out, runs = fused(x, ids, weights)
            if runs is not None:  # an accelerator does not count them (a host sync)
                self._runs += runs
        else:
            out = self._grouped(x, ops, weights, ids, first_prompt_row)
        if self.shared is not None:
            out = out + self._shared(x, ops, first_prompt_row)
        return out.to(x.dtype)

    @property
    def expert_runs(self) -> int:
        """Expert MLPs run since construction (each reads its weights once),
        the C++ layer stack's included: what benchmarks/moe.py turns into
        expert bytes read per step."""
        return self._runs + getattr(self._fused, "stack_runs", 0)

    @expert_runs.setter
    def expert_runs(self, value: int) -> None:  # an older __call__ counts with += (moe_step_paired.py)
        self._runs = value - getattr(self._fused, "stack_runs", 0)

    def route_rows(self, x: torch.Tensor, ops, fused=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Step 1: (weights, ids) of x's rows. The layer ops' router where
        they have one (``ops.moe_route(x, router, spec)``: the CPU's C++
        pass, on every CPU path alike), else the one-call experts' own
        gating operator (``fused.route(logits, spec)``: the NPU's), else
        ``route`` on ``router_logits``."""
        routed = _platform_rows(ops, x, self.router, self.spec)
        if routed is not None:
            return routed
        logits = router_logits(x, self.router)
        platform_route = getattr(fused, "route", None)  # the NPU's gating operator
        return platform_route(logits, self.spec) if platform_route else route(logits, self.spec)

    def _fused_experts(self, ops):
        """The layer ops' one-call experts on one device, else None:
        ``ops.moe_experts(gate_up, down, mlp)`` gives a callable ``(x, ids,
        weights) -> (out, experts run or None)`` taking rows of the dtypes
        it names in ``dtypes`` (none named: float32), optionally with its own
        ``route(logits, spec)`` (the CPU's packed int8 paths; CUDA's grouped
        GEMM, backends/cuda/moe.py; torch_npu's MoE operators,
        backends/npu/moe.py)."""
        if self._fused_ops is not ops:
            make = getattr(ops, "moe_experts", None)
            single = isinstance(self.parallel, SingleDevice)
            self._fused = make(self.gate_up, self.down, self.mlp) if make is not None and single else None
            self._fused_ops = ops
        return self._fused

    def _grouped(self, x: torch.Tensor, ops, weights: torch.Tensor, ids: torch.Tensor,
                 first_prompt_row: int | None) -> torch.Tensor:
        """Steps 2-4 as torch ops over the platform's linears."""
        k = self.spec.top_k
        rows = x.shape[0]
        groups = _group_slots(ids.tolist(), first_prompt_row)  # one host transfer per layer
        self._runs += len(groups)
        order = [slot for _, slots, _ in groups for slot in slots]
        identity = order == list(range(rows * k))  # batch 1: every choice its own expert
        if rows == 1:
            inputs = [x] * len(groups)  # the one row, no gather
        else:
            xs = x.index_select(0, torch.tensor([slot // k for slot in order]))
            inputs = list(xs.split([len(slots) for _, slots, _ in groups]))

        # one activation pass over every expert's gate/up rows (elementwise: row-invariant)
        gate_up = torch.cat([linear(xe, self.gate_up[e], first_prompt_row=gen)
                             for xe, (e, _, gen) in zip(inputs, groups)])
        act = self.parallel.gather_inputs(mlp_activation(ops, gate_up, self.mlp), "experts")
        starts = _starts([len(slots) for _, slots, _ in groups])
        ys = self.parallel.gather_outputs(torch.cat([
            linear(act[a:a + len(slots)], self.down[e], first_prompt_row=gen)
            for a, (e, slots, gen) in zip(starts, groups)]))
        if not identity:  # back to slot order: slot s at row s of ys
            position = [0] * len(order)
            for i, slot in enumerate(order):
                position[slot] = i
            ys = ys.index_select(0, torch.tensor(position))
        return combine_choices(ys, weights, k)

    def _shared(self, x: torch.Tensor, ops, first_prompt_row: int | None) -> torch.Tensor:
        gate_up, down = self.shared
        act = mlp_activation(ops, linear(x, gate_up, first_prompt_row=first_prompt_row), self.mlp)
        y = self.parallel.output_projection(act, down, "shared", first_prompt_row=first_prompt_row)
        if self.shared_gate is not None:
            y = self._shared_gate_rows(x, ops) * y
        return y

    def _shared_gate_rows(self, x: torch.Tensor, ops) -> torch.Tensor:
        """The shared expert's gate [T, 1]: sigmoid(x . shared_gate), through
        the layer ops' router where they have one (one expert, sigmoid
        scoring: the CPU's C++ pass, which its layer stack also takes)."""
        routed = _platform_rows(ops, x, self.shared_gate, SHARED_GATE)
        if routed is not None:
            return routed[0]
        return elementwise.sigmoid(router_logits(x, self.shared_gate))


def combine_choices(ys: torch.Tensor, weights: torch.Tensor, k: int) -> torch.Tensor:
    """Expert outputs in slot order (row r's j-th choice at row r * k + j
    of ``ys``) -> each row's weighted sum over its choices, in choice order
    (first choice first): no other row changes a row's sum."""
    rows = ys.shape[0] // k
    terms = ys.view(rows, k, -1) * weights.to(ys.dtype).unsqueeze(-1)
    out = terms[:, 0] + terms[:, 1] if k > 1 else terms[:, 0].clone()
    for j in range(2, k):
        out += terms[:, j]
    return out


def _group_slots(ids: list[list[int]], first_prompt_row: int | None) -> list[tuple[int, list[int], int | None]]:
    """A step's expert choices (row r's j-th choice at ids[r][j], slot
    r * k + j) grouped by expert on the host: (expert, its slots in slot
    order, how many of them belong to generating rows -- None when the
    caller does not say), experts in order of first choice. Generating rows
    come first, so their slots lead each expert's list."""
    by_expert: dict[int, list[int]] = {}
    slot = 0
    for choices in ids:
        for e in choices:
            by_expert.setdefault(e, []).append(slot)
            slot += 1
    if first_prompt_row is None:
        return [(e, slots, None) for e, slots in by_expert.items()]
    first_prompt_slot = first_prompt_row * len(ids[0]) if ids else 0
    return [(e, slots, sum(s < first_prompt_slot for s in slots)) for e, slots in by_expert.items()]


def _starts(sizes: list[int]) -> list[int]:
    out, start = [], 0
    for n in sizes:
        out.append(start)
        start += n
    return out


__all__ = ["MoeMlp", "combine_choices", "route", "router_logits"]
