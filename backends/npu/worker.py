"""The NPU worker: the accelerator worker (backends/accelerator/worker.py:
the KV cache sized per engine instance from a profiled worst-case step,
through torch.npu's memory statistics) attending with NpuBackend
(torch_npu's fused operators; docs/ascend.md), a mixture-of-experts model's
experts through torch_npu's MoE operators where it has them (layer_ops.py).

Sizing also respects the one-token branch's documented limit: a layer's
key (and value) tensor may hold at most 2**31 - 1 elements, so the block
count is capped there (logged) instead of failing at the first decode.
"""

from __future__ import annotations

import logging

from paged.backends.accelerator.worker import AcceleratorWorker

log = logging.getLogger("paged.engine")


class NpuWorker(AcceleratorWorker):
    def attention_backend_cls(self):
        from paged.backends.npu.attention import NpuBackend  # torch_npu only when a model loads

        return NpuBackend

    def layer_ops(self, dtype):
        """torch's elementwise ops and, where the installed torch_npu has
        them, its MoE operators for a mixture-of-experts model (layer_ops.py)."""
        from paged.backends.npu.attention import _torch_npu
        from paged.backends.npu.layer_ops import NpuLayerOps

        return NpuLayerOps(_torch_npu())

    def determine_num_blocks(self, requested_bytes, max_model_len, max_num_seqs, max_num_batched_tokens):
        from paged.backends.npu import layout

        blocks = super().determine_num_blocks(requested_bytes, max_model_len, max_num_seqs, max_num_batched_tokens)
        be = self.backend
        if not hasattr(be, "operators"):  # --attention-backend reference: no NPU operator limits
            return blocks
        limit = layout.max_decode_blocks(be.block_size, be.num_kv_heads, be.head_size)
        if blocks > limit:
            log.info("KV cache: %d blocks capped at %d (the one-token operator takes at most 2**31 - 1 elements "
                     "per layer's key and value cache)", blocks, limit)
        return min(blocks, limit)

    def startup_summary(self) -> str:
        """The operator keywords read from the installed torch_npu."""
        plan = getattr(self.backend, "operators", None)  # None with --attention-backend reference
        lines = [plan.describe()] if plan is not None else []
        moe_line = getattr(getattr(self.model, "ops", None), "moe_summary", None)
        if moe_line and any(getattr(layer, "moe", None) is not None for layer in getattr(self.model, "layers", ())):
            lines.append(moe_line)
        return "; ".join(lines)
