"""The CUDA worker: the accelerator worker (backends/accelerator/worker.py:
the KV cache sized from a profiled worst-case step, per engine instance)
with CUDA graphs; a mixture-of-experts model's experts as torch's grouped
GEMM where it applies (layer_ops.py, moe.py).

- profiling: the shared worst-case step, plus ``held_bytes``: what stays
  allocated beside the KV cache for the whole run. With graphs: the largest
  decode graph (largest batch, largest split bucket) is captured over a
  one-block temporary cache and the device's free memory is read before
  and after (the graph pool, the static buffers with the split-K
  workspace, the graph executable); every other graph is captured into the
  same pool after it, reusing what it freed. With --enforce-eager: the
  split-K workspace of the largest batch at the longest sequence, which an
  eager decode step allocates on top of the activations. The capture of
  all graphs then logs what the pool really took next to that estimate.
- CUDA graphs for decode steps (graphs.py), captured once the cache exists,
  unless --enforce-eager: one per (batch size, split bucket), the block
  table as wide as the longest sequence (--max-model-len; with
  --num-kv-blocks the engine passes none, so the model's context bounds it).
"""

from __future__ import annotations

import logging


from paged.backends.accelerator.worker import AcceleratorWorker, profile_seq_lens
from paged.backends.cuda import launch
from paged.backends.cuda.graphs import MAX_GRAPH_WORKSPACE, CudaGraphRunner
from paged.platforms.sizes import format_size

__all__ = ["CudaWorker", "profile_seq_lens", "eager_workspace_bytes"]

log = logging.getLogger("paged.engine")


def eager_workspace_bytes(max_num_seqs: int, num_heads: int, head_size: int, max_len: int,
                          sliding_window: int = 0) -> int:
    """The split-K workspace of an eager decode step of ``max_num_seqs``
    sequences whose longest holds ``max_len`` tokens: the most any eager
    step allocates for it."""
    return launch.workspace_bytes(max_num_seqs, num_heads, launch.decode_splits(max_len, sliding_window), head_size)


class CudaWorker(AcceleratorWorker):
    enforce_eager = False

    def attention_backend_cls(self):
        from paged.backends.cuda.attention import CudaBackend  # imports torch.cuda only when a model loads

        return CudaBackend

    def init_device(self, max_num_seqs: int = 64, enforce_eager: bool = False, **options) -> None:
        self.enforce_eager = bool(enforce_eager)
        super().init_device(max_num_seqs=max_num_seqs, device=self.device.index, **options)

    def layer_ops(self, dtype):
        """torch's elementwise ops; a mixture-of-experts model's experts as
        torch's grouped GEMM where it applies (layer_ops.py)."""
        from paged.backends.cuda.layer_ops import CudaLayerOps

        return CudaLayerOps()

    def _graph_runner(self, num_blocks: int, max_len: int) -> CudaGraphRunner:
        return CudaGraphRunner(self.model, self.backend, self.num_layers, num_blocks, self.backend.block_size,
                               self.device, self.max_num_seqs, max_len)

    def held_bytes(self) -> int:
        be = self.backend
        max_len = self.longest_sequence(1 << 40)  # before sizing: --max-model-len or the model's context
        eager = eager_workspace_bytes(self.max_num_seqs, be.num_heads, be.head_size, max_len, be.sliding_window)
        if self.enforce_eager:
            return eager
        mem = self.platform.device_memory()
        mem.settle()
        before = mem.snapshot()
        runner = self._graph_runner(1, max_len)
        cache = self.bytes_per_block  # the one-block temporary cache is not the graphs'
        runner.capture(runner.graph_keys()[:1])  # the largest graph
        after = mem.snapshot()
        graphs = max(0, before.free - after.free - cache)
        uncaptured = len(runner.buckets) < len(launch.split_buckets(launch.decode_splits(
            runner.width * be.block_size, be.sliding_window)))
        del runner
        be.num_blocks = None
        mem.settle()
        # steps past the largest captured bucket run eagerly, with their own workspace
        held = graphs + (eager if uncaptured else 0)
        self._graph_estimate = graphs
        log.info("profiled the largest decode graph: %s%s", format_size(graphs),
                 f" + {format_size(eager)} eager split-K workspace (buckets above the "
                 f"{format_size(MAX_GRAPH_WORKSPACE)} graph workspace run eagerly)" if uncaptured else "")
        return held

    def init_kv_cache(self, num_blocks: int) -> None:
        if self.enforce_eager:
            super().init_kv_cache(num_blocks)
            return
        mem = self.platform.device_memory()
        self.runner = self._graph_runner(num_blocks, self.longest_sequence(num_blocks))
        mem.settle()
        before = mem.snapshot().free
        self.runner.capture()
        took = max(0, before - mem.snapshot().free)
        estimate = getattr(self, "_graph_estimate", None)
        if estimate is not None and took > estimate:
            log.warning("CUDA graphs took %s, more than the %s profiled for the largest one: the KV budget "
                        "was %s too large (lower --gpu-memory-utilization if memory runs out)",
                        format_size(took), format_size(estimate), format_size(took - estimate))
        else:
            log.info("CUDA graphs hold %s", format_size(took))
