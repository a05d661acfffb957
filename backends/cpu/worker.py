"""The CPU worker: the generic Worker (core/worker.py) with the CPU's fast
paths chosen here, not in the model.

- layer ops: the fused C++ passes of csrc_cpu/ops (backends/cpu/layer_ops.py)
  for float32 / bfloat16, else torch's;
- stack runner: ``LayerStack``, every decoder layer of a step in one C++ call,
  where the model is eligible (backends/cpu/layer_stack.py);
- profiling: none. The KV budget is a share of the host memory available
  after the weights are loaded; a step's activations are small beside it.
"""

from __future__ import annotations

import torch

from paged.backends.cpu.layer_ops import fused_layer_ops
from paged.backends.cpu.layer_stack import LayerStack
from paged.core.models.layers import TorchLayerOps
from paged.core.worker import Worker

__all__ = ["CpuWorker", "prepare_model"]


def cpu_layer_ops(dtype: torch.dtype) -> TorchLayerOps:
    """The fused C++ passes where they apply, else torch's ops."""
    return fused_layer_ops(dtype) or TorchLayerOps()


class CpuWorker(Worker):
    def layer_ops(self, dtype: torch.dtype) -> TorchLayerOps:
        return cpu_layer_ops(dtype)

    def stack_runner(self, model):
        return LayerStack.for_model(model)


def prepare_model(model) -> None:
    """Gives a model built outside an engine (tests, benchmarks) the CPU
    worker's layer ops and stack runner."""
    model.ops = cpu_layer_ops(model.dtype)
    model.layer_stack = LayerStack.for_model(model)
