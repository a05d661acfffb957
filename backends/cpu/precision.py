"""The CPU's precision plan: which arithmetic each matrix takes and which
kernel prompt rows attend on, decided once from the platform's choice of
activations (``CpuWorker.linear_activations``) and handed, as data, to
whatever builds or runs the model: the packed-weight factory (each matrix
made with its arithmetic, from its role: core/models/layers.py MatrixRole),
the attention backend (its prompt kernel, set as it is made), the C++ layer
stack (each layer's one-term flag at ``add_layer``) and every tensor-parallel
rank (each builds the same plan from the same setting and depth). Nothing
changes a model's precision after it is built.

Today's plans (docs/precision.md):

- "mixed": one int8 term for every row of the O, gate/up and down
  projections of ``one_term_layers(num_layers)``, two elsewhere (QKV, the
  K/V projection, and the LM head included); prompt rows attend on the
  lane-major float32 kernel where it runs;
- "mixed-bf16": int8x2 for generating rows, bfloat16 tiles for prompt rows,
  prompt attention in bfloat16 (AMX CPUs);
- "float32", "int8", "int8x2": that arithmetic for every matrix, the shared
  prompt attention.
"""

from __future__ import annotations

from dataclasses import dataclass

from paged.backends.cpu.quant_linear import CpuPackedLinear, check_activations, one_term_layers
from paged.core.models.layers import MatrixRole

#: prompt-row attention kernel of each plan (CpuBackend.prompt_attention)
PROMPT_ATTENTION = {"mixed-bf16": "bf16", "mixed": "lanes"}
#: the matrices "mixed" may put on one term (never the K/V projection, whose outputs are cached)
ONE_TERM_KINDS = ("o_proj", "gate_up", "down")


@dataclass(frozen=True)
class MatrixPrecision:
    """One matrix's arithmetic: ``activations`` (quant_linear.ACTIVATIONS)
    and, under "mixed", whether every row takes one int8 term."""

    activations: str
    one_term: bool = False


@dataclass(frozen=True)
class PrecisionPlan:
    """``activations``: the platform's choice for the model's packed
    matrices (None: weights are dense, nothing to plan)."""

    activations: str | None

    def __post_init__(self):
        if self.activations is not None:
            check_activations(self.activations)

    @property
    def prompt_attention(self) -> str:
        return PROMPT_ATTENTION.get(self.activations, "float32")

    def one_term(self, layer: int | None, num_layers: int) -> bool:
        """Whether ``layer``'s O, gate/up and down take one int8 term."""
        return self.activations == "mixed" and layer is not None and layer in one_term_layers(num_layers)

    def matrix(self, role: MatrixRole | None) -> MatrixPrecision:
        one = role is not None and role.kind in ONE_TERM_KINDS and self.one_term(role.layer, role.num_layers)
        return MatrixPrecision(self.activations, one)

    def describe(self) -> str:
        return f"{self.activations} (prompt attention {self.prompt_attention})"


class PlannedPackedLinear:
    """The CPU worker's packed-weight factory (Worker.packed_linear): each
    packed matrix becomes a CpuPackedLinear with the arithmetic the plan
    gives its role, set as it is made."""

    takes_role = True  # core/models/decoder.py hands each matrix's MatrixRole
    takes_row_parts = CpuPackedLinear.takes_row_parts  # and a fused matrix of several layouts as PackedParts

    def __init__(self, plan: PrecisionPlan):
        self.plan = plan

    def __call__(self, packed, role: MatrixRole | None = None) -> CpuPackedLinear:
        p = self.plan.matrix(role)
        return CpuPackedLinear(packed, activations=p.activations, one_term=p.one_term)


def plan_of(model) -> PrecisionPlan:
    """The plan a model built outside an engine was made for, read from its
    decoder matrices: their one activations setting (several: none, each
    matrix keeps its own)."""
    modes = {getattr(w, "activations", None) for layer in model.decoder_stack().layers
             for _, w in layer.matrices()}
    mode = modes.pop() if len(modes) == 1 else None
    return PrecisionPlan(mode)


__all__ = ["PrecisionPlan", "MatrixPrecision", "PlannedPackedLinear", "plan_of", "PROMPT_ATTENTION"]
