"""The CPU worker: the generic Worker (core/engine/worker.py) with the CPU's fast
paths chosen here, not in the model.

- layer ops: the fused C++ passes of csrc_cpu/ops (backends/cpu/layer_ops.py)
  for float32 / bfloat16, else torch's;
- stack runner: ``LayerStack``, every decoder layer of a step in one C++ call,
  where the model is eligible (backends/cpu/layer_stack.py);
- weight panels: the int8 kernel's panels kept per matrix where the model is
  small enough (backends/cpu/quant_linear.py plan_weight_panels), built
  before the stack, which takes them ("mixed-bf16" makes its prompt rows'
  bfloat16 tiles from them);
- profiling: none. The KV budget is a share of the host memory available
  after the weights are loaded; a step's activations are small beside it.
"""

from __future__ import annotations

import functools

import torch

from paged.backends.cpu import quant_linear
from paged.backends.cpu.attention import CpuBackend
from paged.backends.cpu.host import isa
from paged.backends.cpu.host.cpulist import format_cpulist
from paged.backends.cpu.layer_ops import fused_layer_ops
from paged.backends.cpu.layer_stack import LayerStack
from paged.backends.cpu.quant_linear import one_term_layers, plan_weight_panels
from paged.core.engine.worker import Worker
from paged.core.models.layers import TorchLayerOps

__all__ = ["CpuWorker", "prepare_model"]


def cpu_layer_ops(dtype: torch.dtype) -> TorchLayerOps:
    """The fused C++ passes where they apply, else torch's ops."""
    return fused_layer_ops(dtype) or TorchLayerOps()


class CpuWorker(Worker):
    extra_kv_cache_dtypes = ("float32", "bfloat16", "float16", "int8", "fp8_e4m3")

    def attention_backend_cls(self):
        return CpuBackend

    def linear_activations(self, setting: str = "auto") -> str | None:
        """auto = mixed, or mixed-bf16 with AMX-BF16 (docs/kernels.md, "Choosing the CPU path")."""
        return quant_linear.resolve_activations(setting) if quant_linear.available() else None

    def packed_linear(self, activations: str):
        return functools.partial(quant_linear.CpuPackedLinear, activations=activations)

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

    def layer_ops(self, dtype: torch.dtype) -> TorchLayerOps:
        return cpu_layer_ops(dtype)

    def stack_runner(self, model):
        return LayerStack.for_model(model)

    def prepare_model(self, model) -> None:
        plan_weight_panels(packed_matrices(model))  # memory before the KV budget; the stack takes them
        set_prompt_attention(model)
        set_one_term_layers(model)
        super().prepare_model(model)


def set_prompt_attention(model) -> None:
    """A "mixed-bf16" model's prompt rows attend in bfloat16 too, a "mixed"
    model's on the lane-major float32 kernel (the backend's
    prompt_attention; the layer stack follows its activations)."""
    mats = decoder_matrices(model)
    modes = {getattr(w, "activations", None) for w in mats}
    mode = modes.pop() if len(modes) == 1 else None  # per-matrix modes: no prompt kernel of their own
    kind = {"mixed-bf16": "bf16", "mixed": "lanes"}.get(mode, "float32")
    for layer in model.decoder_stack().layers:
        if isinstance(layer.attn_backend, CpuBackend):
            layer.attn_backend.prompt_attention = kind


def set_one_term_layers(model, middle=None) -> None:
    """A "mixed" model's middle layers (``middle``, default one_term_layers)
    compute every row on one int8 term outside QKV (their matrices'
    one_term; a layer stack built afterwards follows it)."""
    layers = model.decoder_stack().layers
    middle = set(one_term_layers(len(layers)) if middle is None else middle)
    for i, layer in enumerate(layers):
        for w in (layer.o_proj, layer.gate_up, layer.down):
            if getattr(w, "activations", None) == "mixed":
                w.one_term = i in middle


def decoder_matrices(model) -> list:
    """Every matrix of the model's decoder layers."""
    return [w for layer in model.decoder_stack().layers for w in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)]


def packed_matrices(model) -> list:
    """Every matrix of the model's decoder layers and its LM head."""
    return decoder_matrices(model) + [model.lm_head]


def prepare_model(model) -> None:
    """Gives a model built outside an engine (tests, benchmarks) the CPU
    worker's layer ops and stack runner."""
    model.ops = cpu_layer_ops(model.dtype)
    plan_weight_panels(packed_matrices(model))
    set_prompt_attention(model)
    set_one_term_layers(model)
    model.layer_stack = LayerStack.for_model(model)
