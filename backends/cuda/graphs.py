"""CUDA graphs for decode steps (on by default; ``--enforce-eager`` turns
them off).

A decode step launches a few kernels per layer; at small batches the GPU
waits on those launches. ``CudaGraphRunner`` captures the whole model
forward once per *padded batch size* (``capture_sizes``: 1, 2, 4, then
multiples of 8 up to max_num_seqs) over static input buffers, and a decode
step of n sequences replays the graph of the smallest size >= n
(``padded_size``) after copying its inputs into the buffers' first n rows.

Padding rows are inert: slot -1 (the cache write skips it) and sequence
length 0 (attention reads no key and writes nothing for it); their outputs
are discarded. The block-table buffer is as wide as the longest sequence
the cache can hold, so the split-K partition count is the one for that width;
each sequence still uses the partitions its own length needs (the kernel's
batch invariance), so a replayed step computes the attention of an eager
one. Steps with prefills (prompt logprobs come with those), more than one token
per sequence or more sequences than the largest graph run eagerly; the choice
depends on the step's shape alone, so every tensor-parallel rank makes the
same one.
"""

from __future__ import annotations

import bisect
import logging
import time

import torch

from paged.backends.base import AttentionMetadata
from paged.backends.cuda.metadata import CudaMetadata
from paged.core.engine.model_runner import ModelRunner, StepInputs

log = logging.getLogger("paged.engine")

__all__ = ["CudaGraphRunner", "capture_sizes", "padded_size"]


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, 16, 24, ... up to max_num_seqs,
    and max_num_seqs itself (ascending)."""
    if not isinstance(max_num_seqs, int) or max_num_seqs < 1:
        raise ValueError(f"max_num_seqs: expected a positive integer, got {max_num_seqs!r}")
    sizes = {s for s in (1, 2, 4) if s <= max_num_seqs}
    sizes.update(range(8, max_num_seqs + 1, 8))
    sizes.add(max_num_seqs)
    return sorted(sizes)


def padded_size(n: int, sizes: list[int]) -> int | None:
    """The smallest captured size >= n (ascending ``sizes``); None when n
    exceeds them all (the step runs eagerly)."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if n >= 1 and i < len(sizes) else None


class CudaGraphRunner(ModelRunner):
    """A ModelRunner that replays captured graphs for pure decode steps."""

    def __init__(self, model, attn_backend, num_layers: int, num_blocks: int, block_size: int,
                 device: torch.device, max_num_seqs: int, max_model_len: int | None):
        super().__init__(model, attn_backend, num_layers, num_blocks, block_size, device)
        self.sizes = capture_sizes(max_num_seqs)
        tokens = num_blocks * block_size if max_model_len is None else min(max_model_len, num_blocks * block_size)
        self.width = -(-tokens // block_size)  # block-table columns of the static buffer
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def _static_buffers(self, n: int) -> None:
        dev, be = self.device, self.backend
        self.ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.pos = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slots = torch.full((n,), -1, dtype=torch.int64, device=dev)
        self.lens = torch.zeros(n, dtype=torch.int32, device=dev)
        self.tables = torch.zeros((n, self.width), dtype=torch.int32, device=dev)
        self.qsl = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.splits = be.decode_splits(self.width)
        self.split_out, self.split_max_sum = be.split_workspace(n, self.splits)

    def _static_meta(self, n: int) -> CudaMetadata:
        common = AttentionMetadata(slot_mapping=self.slots[:n], query_start_loc=self.qsl[:n + 1],
                                   seq_lens=self.lens[:n], block_tables=self.tables[:n], num_decodes=n,
                                   max_query_len=1, max_seq_len=self.width * self.block_size)
        return CudaMetadata(**common.common_fields(), prefill_max_query_len=1, decode_splits=self.splits,
                            split_out=self.split_out[:n], split_max_sum=self.split_max_sum[:n])

    @torch.inference_mode()
    def capture(self) -> None:
        """One graph per size, largest first, all in one memory pool."""
        t0 = time.perf_counter()
        self._static_buffers(self.sizes[-1])
        pool = None
        for n in reversed(self.sizes):
            meta = self._static_meta(n)
            self.model(self.ids[:n], self.pos[:n], self.kv_caches, meta)  # lazy init outside the capture
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self.model(self.ids[:n], self.pos[:n], self.kv_caches, meta)
            pool = graph.pool()
            self.graphs[n] = (graph, out)
        torch.cuda.synchronize(self.device)
        log.info("CUDA graphs: %d decode batch sizes (%s) captured in %.1f s (--enforce-eager skips them)",
                 len(self.sizes), ",".join(map(str, self.sizes)), time.perf_counter() - t0)

    def run_model(self, inp: StepInputs) -> torch.Tensor:
        meta = inp.meta
        n = meta.num_seqs
        one_token_each = meta.num_decodes == n and inp.input_ids.shape[0] == n  # (no draft rows)
        size = padded_size(n, self.sizes) if self.graphs and one_token_each else None
        width = meta.block_tables.shape[1]
        if size is None or width > self.width:
            return super().run_model(inp)
        self.ids[:n].copy_(inp.input_ids)
        self.pos[:n].copy_(inp.positions)
        self.slots[:n].copy_(meta.slot_mapping)
        self.slots[n:size].fill_(-1)
        self.lens[:n].copy_(meta.seq_lens)
        self.lens[n:size].zero_()
        self.tables[:n, :width].copy_(meta.block_tables)
        graph, out = self.graphs[size]
        graph.replay()
        return out[:n]
