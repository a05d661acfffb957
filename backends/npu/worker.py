"""The NPU worker: the generic Worker (core/engine/worker.py) attending with
NpuBackend (torch_npu's fused operators); layer ops and sizing are the
generic torch ones (docs/ascend.md)."""

from __future__ import annotations

from paged.core.engine.worker import Worker


class NpuWorker(Worker):
    def attention_backend_cls(self):
        from paged.backends.npu.attention import NpuBackend  # torch_npu only when a model loads

        return NpuBackend
