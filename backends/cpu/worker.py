"""The CPU worker: the generic Worker (core/engine/worker.py) with the CPU's fast
paths chosen here, not in the model.

- layer ops: the fused C++ passes of csrc_cpu/ops (backends/cpu/layer_ops.py)
  for float32 / bfloat16, else torch's;
- stack runner: ``LayerStack``, every decoder layer of a step in one C++ call,
  executing the model's description where it has the kernels for it
  (backends/cpu/layer_stack.py; ``decline_reason`` names what it lacks);
- precision: one plan (backends/cpu/precision.py) built from
  ``linear_activations`` before the model, handed to the packed-weight
  factory (each matrix made with its arithmetic), to the attention backend
  as it is made (its prompt kernel) and to the stack; nothing is changed
  after the build;
- weight panels: the int8 kernel's panels kept per matrix in place of its
  packed arrays (backends/cpu/quant_linear.py plan_weight_panels), built
  before the stack, which takes them ("mixed-bf16" makes its prompt rows'
  bfloat16 tiles from them);
- profiling: none. The KV budget is a share of the host memory available
  after the weights are loaded; a step's activations are small beside it.
"""

from __future__ import annotations

import torch

from paged.backends.cpu import quant_linear
from paged.backends.cpu.attention import CpuBackend
from paged.backends.cpu.host import isa
from paged.backends.cpu.host.cpulist import format_cpulist
from paged.backends.cpu.host.heap import release_free_heap
from paged.backends.cpu.layer_ops import fused_layer_ops
from paged.backends.cpu.layer_stack import LayerStack
from paged.backends.cpu.precision import PlannedPackedLinear, PrecisionPlan, plan_of
from paged.backends.cpu.quant_linear import plan_weight_panels
from paged.core.engine.worker import Worker
from paged.core.models.layers import MatrixRole, TorchLayerOps

__all__ = ["CpuWorker", "prepare_model"]


def cpu_layer_ops(dtype: torch.dtype) -> TorchLayerOps:
    """The fused C++ passes where they apply, else torch's ops."""
    return fused_layer_ops(dtype) or TorchLayerOps()


class CpuWorker(Worker):
    extra_kv_cache_dtypes = ("float32", "bfloat16", "float16", "int8", "fp8_e4m3")
    #: the precision plan of the model being loaded (load_model makes it first)
    plan: PrecisionPlan | None = None

    def attention_backend_cls(self):
        return CpuBackend

    def select_attention_backend(self, choice: str | None = None):
        """The backend class, or for the CPU's own a maker that sets its
        prompt-row kernel from the plan as it makes it."""
        cls = super().select_attention_backend(choice)
        plan = self.plan
        if plan is None or not issubclass(cls, CpuBackend):
            return cls

        def make(*args, **kwargs):
            return cls(*args, prompt_attention=plan.prompt_attention, **kwargs)

        return make

    def load_model(self, config, weights, dtype, block_size, linear_activations=None, attention_backend=None,
                   kv_cache_dtype=None):
        self.plan = PrecisionPlan(linear_activations)  # before anything is made from it
        return super().load_model(config, weights, dtype, block_size, linear_activations, attention_backend,
                                  kv_cache_dtype)

    def linear_activations(self, setting: str = "auto") -> str | None:
        """auto = mixed, or mixed-bf16 with AMX-BF16 (docs/kernels.md, "Choosing the CPU path")."""
        return quant_linear.resolve_activations(setting) if quant_linear.available() else None

    def packed_linear(self, activations: str):
        """Each matrix made with the arithmetic the plan gives its role."""
        plan = self.plan if self.plan is not None and self.plan.activations == activations else \
            PrecisionPlan(activations)
        return PlannedPackedLinear(plan)

    def auto_kv_cache_dtype(self, model_dtype, linear_activations: str | None = None):
        """float16 under a float32 model whose linears already quantize their
        activations (int8 / int8x2 / mixed): decode attention reads the cache
        and is bound by it, and float16 halves the bytes at the same greedy
        agreement as float32 on the accuracy gate (docs/accuracy.md). The exact
        float32 path (--linear-activations float32, or unpacked weights) keeps a
        float32 cache."""
        if model_dtype == torch.float32 and linear_activations not in (None, "float32"):
            return torch.float16
        return model_dtype

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """torch's CPU argmax is a scalar loop (0.65 ms for 16 x 49152 logits
        on two Zen 4 cores); _C_cpu.argmax_rows vectorises it (0.11 ms) with
        the same answer. Other tensors go to torch."""
        if (logits.device.type != "cpu" or logits.dtype != torch.float32 or logits.dim() != 2
                or 0 in logits.shape or not logits.is_contiguous()):
            return super().argmax(logits)
        out = torch.empty(logits.shape[0], dtype=torch.int64)
        self.platform.ops_module().argmax_rows(logits, out)
        return out

    def startup_summary(self) -> str:
        plan = self.platform.plan
        if plan is None or not plan.cpus:
            threads = f"{torch.get_num_threads()} threads, not pinned"
        else:
            threads = f"{len(plan.cpus)} threads on CPUs {format_cpulist(plan.cpus)}"
        builds = ", ".join(f"{family} {build}" for family, build in isa.active_builds().items())
        hidden = self.platform.ops_module().hidden_cpu_features()
        return f"{threads}; kernels: {builds}" + (f" (PAGED_CPU_HIDE hides {', '.join(hidden)})" if hidden else "")

    def init_kv_cache(self, num_blocks: int) -> None:
        release_free_heap()  # what loading freed: the engine has dropped the file's blocks by now
        super().init_kv_cache(num_blocks)

    def layer_ops(self, dtype: torch.dtype) -> TorchLayerOps:
        return cpu_layer_ops(dtype)

    def stack_runner(self, model):
        return stack_for(model)

    def prepare_model(self, model) -> None:
        plan_weight_panels(panel_matrices(model))  # memory before the KV budget; the stack takes them
        super().prepare_model(model)
        model.ops = ops_for(model)


def ops_for(model) -> TorchLayerOps:
    """The fused C++ passes (every op a family's description needs but
    LayerNorm and an ungated MLP's activation, which stay torch's)."""
    return cpu_layer_ops(model.dtype)


def stack_for(model):
    """The C++ layer stack for ``model``, or None where it declines
    (backends/cpu/layer_stack.py decline_reason names why)."""
    return LayerStack.for_model(model)


def apply_plan(model, plan: PrecisionPlan) -> None:
    """A model built outside an engine, its matrices made without their
    roles (a plain factory, as tests and benchmarks pass): gives them and
    its CPU backend what ``plan`` says, as the engine's factory and backend
    maker would have made them."""
    layers = model.decoder_stack().layers
    n = len(layers)
    for i, layer in enumerate(layers):
        for kind, w in layer.matrices():  # every expert's too
            if getattr(w, "activations", None) == "mixed":
                w.one_term = plan.matrix(MatrixRole(kind, i, n)).one_term
        backend = getattr(layer.attn_backend, "backend", layer.attn_backend)  # a LayerAttention's own
        if isinstance(backend, CpuBackend):
            backend.prompt_attention = plan.prompt_attention


def decoder_matrices(model) -> list:
    """Every matrix of the model's decoder layers (a mixture's experts too)."""
    return [w for layer in model.decoder_stack().layers for _, w in layer.matrices()]


def panel_matrices(model) -> list:
    """The matrices that get persistent weight panels: the decoder layers'
    (a mixture's routed and shared experts included: the one-call experts
    read the panels too) and the LM head."""
    out = []
    for layer in model.decoder_stack().layers:
        out += [layer.qkv, layer.o_proj]
        if layer.moe is None:
            out += [layer.gate_up, layer.down]
        else:
            out += [w for _, w in layer.moe.matrices()]
    return out + [model.lm_head]


def prepare_model(model) -> None:
    """Gives a model built outside an engine (tests, benchmarks) its
    precision plan (read from its matrices' activations: ``apply_plan``),
    the CPU worker's layer ops and stack runner."""
    apply_plan(model, plan_of(model))
    plan_weight_panels(panel_matrices(model))
    model.ops = ops_for(model)
    model.layer_stack = stack_for(model)
