"""The mixture-of-experts MLP (core/models/spec.py MoeSpec) as torch ops:
what every platform runs (the reference backend's oracle, the CPU's packed
experts, CUDA and NPU through the same ops).

One step, grouped by expert so each expert's weights are read once per step
(not once per row that chose it):

1. the router scores every row (``router_logits``: one product per row, so
   a row's expert choice does not depend on its batch), ``route`` picks the
   top-k experts and their weights;
2. the (row, k-th choice) slots are sorted by expert (stably: a row's slots
   keep row order within an expert); each expert gathers its rows, runs its
   gate/up projection and activation (one ``linear`` call per expert);
3. every expert's activations are gathered across tensor-parallel ranks at
   once, each expert's down projection runs on its rows, and the output
   rows are gathered at once (two gathers per layer, as a dense MLP);
4. the outputs are scattered back to their slots and each row sums its k
   weighted outputs in its choice order (first choice first), the same
   order whichever other rows chose the same experts: with row-invariant
   linears (the CPU's packed int8 paths) a row's bits do not depend on its
   batch.
"""

from __future__ import annotations

import torch

from paged.core.models.layers import linear, mlp_activation
from paged.core.models.spec import MlpSpec, MoeSpec


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
    scores = torch.softmax(logits, dim=-1) if spec.scoring == "softmax" else torch.sigmoid(logits)
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
        #: expert MLPs run since construction (each reads its weights once):
        #: what benchmarks/moe.py turns into expert bytes read per step
        self.expert_runs = 0

    def matrices(self) -> list[tuple[str, object]]:
        """(kind, matrix) of every expert and shared-expert matrix."""
        out = [(kind, w) for g, d in zip(self.gate_up, self.down) for kind, w in (("gate_up", g), ("down", d))]
        if self.shared is not None:
            out += [("gate_up", self.shared[0]), ("down", self.shared[1])]
        return out

    def __call__(self, x: torch.Tensor, ops, first_prompt_row: int | None = None) -> torch.Tensor:
        spec, k = self.spec, self.spec.top_k
        rows = x.shape[0]
        weights, ids = route(router_logits(x, self.router), spec)
        flat = ids.reshape(-1)  # slot r * k + j: row r's j-th choice
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=spec.num_experts)
        if first_prompt_row is not None:  # slots of generating rows come first within each expert
            counts = torch.stack((counts, torch.bincount(flat[:first_prompt_row * k], minlength=spec.num_experts)))
        sizes = counts.tolist()  # one host transfer per layer
        per_expert, generating = (sizes, None) if first_prompt_row is None else sizes
        xs = x.index_select(0, order // k)
        segments = [(e, start, n) for e, (start, n) in enumerate(zip(_starts(per_expert), per_expert)) if n]
        self.expert_runs += len(segments)

        def prompt_at(e: int) -> int | None:
            return None if generating is None else generating[e]

        # one activation pass over every expert's gate/up rows (elementwise: row-invariant)
        gate_up = torch.cat([linear(xs[a:a + n], self.gate_up[e], first_prompt_row=prompt_at(e))
                             for e, a, n in segments])
        act = self.parallel.gather_inputs(mlp_activation(ops, gate_up, self.mlp), "experts")
        outs = [linear(act[a:a + n], self.down[e], first_prompt_row=prompt_at(e)) for e, a, n in segments]
        ys = self.parallel.gather_outputs(torch.cat(outs))
        slots = torch.empty_like(ys)
        slots[order] = ys
        slots = slots.view(rows, k, -1) * weights.to(ys.dtype).unsqueeze(-1)
        out = slots[:, 0]
        for j in range(1, k):  # each row's choices in order: no other row changes the sum
            out = out + slots[:, j]
        if self.shared is not None:
            out = out + self._shared(x, ops, first_prompt_row)
        return out.to(x.dtype)

    def _shared(self, x: torch.Tensor, ops, first_prompt_row: int | None) -> torch.Tensor:
        gate_up, down = self.shared
        act = mlp_activation(ops, linear(x, gate_up, first_prompt_row=first_prompt_row), self.mlp)
        y = self.parallel.output_projection(act, down, "shared", first_prompt_row=first_prompt_row)
        if self.shared_gate is not None:
            y = torch.sigmoid(router_logits(x, self.shared_gate)) * y
        return y


def _starts(sizes: list[int]) -> list[int]:
    out, start = [], 0
    for n in sizes:
        out.append(start)
        start += n
    return out


__all__ = ["MoeMlp", "route", "router_logits"]
