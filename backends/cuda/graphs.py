"""CUDA graphs for decode steps (on by default; ``--enforce-eager`` turns
them off).

A decode step launches a few kernels per layer; at small batches the GPU
waits on those launches. ``CudaGraphRunner`` captures the whole model
forward once per (padded batch size, split bucket) over static input
buffers:

- batch sizes (``capture_sizes``): 1, 2, 4, then multiples of 8 up to
  max_num_seqs; a step of n sequences uses the smallest size >= n
  (``padded_size``) after copying its inputs into the buffers' first n rows;
- split buckets (launch.split_buckets): the decode kernel's partitions per
  sequence are fixed when a graph is captured, so each size is captured for
  1, 2, 4, ... partitions up to what the longest sequence the cache holds
  needs; a step replays the smallest bucket covering its own longest decode
  (launch.decode_splits, from the host's lengths): a batch of short
  sequences launches one partition per sequence, not the 256 a 128k
  context would need. Buckets whose workspace for the largest batch would
  exceed ``MAX_GRAPH_WORKSPACE`` are not captured; such steps run eagerly.

Padding rows are inert: slot -1 (the cache write skips it) and sequence
length 0 (attention reads no key and writes nothing for it); their outputs
are discarded. Each sequence uses the partitions its own length needs
whatever the bucket (the kernel's batch invariance), so a replayed step
computes the attention of an eager one. Steps with prefills (prompt
logprobs come with those), more than one token per sequence or more
sequences than the largest graph run eagerly; the choice depends on the
step's shape and lengths alone, so every tensor-parallel rank makes the
same one. One static split-K workspace serves every graph: each uses the
leading [n, H, bucket, D] of it.
"""

from __future__ import annotations

import bisect
import logging
import math
import time

import torch

from paged.backends.base import AttentionMetadata
from paged.backends.cuda import launch
from paged.backends.cuda.metadata import CudaMetadata
from paged.core.engine.model_runner import ModelRunner, StepInputs

log = logging.getLogger("paged.engine")

__all__ = ["CudaGraphRunner", "capture_sizes", "padded_size", "graph_key", "MAX_GRAPH_WORKSPACE"]

#: the static split-K workspace's cap: buckets needing more for the largest
#: batch are not captured (their steps run eagerly, allocating per step)
MAX_GRAPH_WORKSPACE = 512 * 2**20


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


def graph_key(num_seqs: int, max_decode_len: int, sliding_window: int, sizes: list[int],
              buckets: list[int]) -> tuple[int, int] | None:
    """The (padded batch size, split bucket) graph a decode step of
    ``num_seqs`` sequences, the longest ``max_decode_len`` tokens, replays;
    None when no captured graph covers it (the step runs eagerly)."""
    size = padded_size(num_seqs, sizes)
    bucket = launch.bucket_for(launch.decode_splits(max_decode_len, sliding_window), buckets)
    return None if size is None or bucket is None else (size, bucket)


class CudaGraphRunner(ModelRunner):
    """A ModelRunner that replays captured graphs for pure decode steps.
    ``max_len``: the longest sequence (tokens) a step can hold; the block
    table buffer is that wide."""

    def __init__(self, model, attn_backend, num_layers: int, num_blocks: int, block_size: int,
                 device: torch.device, max_num_seqs: int, max_len: int):
        super().__init__(model, attn_backend, num_layers, num_blocks, block_size, device)
        self.sizes = capture_sizes(max_num_seqs)
        self.width = -(-int(max_len) // block_size)  # block-table columns of the static buffer
        be = attn_backend
        self.window = be.sliding_window
        max_splits = launch.decode_splits(self.width * block_size, self.window)
        self.buckets = launch.capped_buckets(max_splits, self.sizes[-1], be.num_heads, be.head_size,
                                             MAX_GRAPH_WORKSPACE)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def _static_buffers(self, n: int) -> None:
        dev, be = self.device, self.backend
        self.ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.pos = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slots = torch.full((n,), -1, dtype=torch.int64, device=dev)
        self.lens = torch.zeros(n, dtype=torch.int32, device=dev)
        self.tables = torch.zeros((n, self.width), dtype=torch.int32, device=dev)
        self.qsl = torch.arange(n + 1, dtype=torch.int32, device=dev)
        top = self.buckets[-1]
        # one flat workspace: graph (m, s) views its leading m x H x s partials
        self.ws_out = torch.empty(n * be.num_heads * top * be.head_size if top > 1 else 0,
                                  dtype=torch.float32, device=dev)
        self.ws_max_sum = torch.empty(n * be.num_heads * top * 2 if top > 1 else 0, dtype=torch.float32, device=dev)

    def _workspace(self, n: int, splits: int) -> tuple[torch.Tensor, torch.Tensor]:
        be = self.backend
        if splits <= 1:
            return be.split_workspace(0, 1)
        shape = (n, be.num_heads, splits)
        return (self.ws_out[:math.prod(shape) * be.head_size].view(*shape, be.head_size),
                self.ws_max_sum[:math.prod(shape) * 2].view(*shape, 2))

    def _static_meta(self, n: int, splits: int) -> CudaMetadata:
        common = AttentionMetadata(slot_mapping=self.slots[:n], query_start_loc=self.qsl[:n + 1],
                                   seq_lens=self.lens[:n], block_tables=self.tables[:n], num_decodes=n,
                                   max_query_len=1, max_seq_len=self.width * self.block_size)
        split_out, split_max_sum = self._workspace(n, splits)
        return CudaMetadata(**common.common_fields(), prefill_max_query_len=1, decode_splits=splits,
                            split_out=split_out, split_max_sum=split_max_sum, window=self.window)

    def graph_keys(self) -> list[tuple[int, int]]:
        """Every (size, bucket) to capture, largest first (one memory pool:
        smaller graphs reuse what larger ones freed)."""
        return sorted(((n, s) for n in self.sizes for s in self.buckets), reverse=True)

    @torch.inference_mode()
    def capture(self, keys: list[tuple[int, int]] | None = None) -> None:
        """One graph per key (default: graph_keys()), largest first, all in one pool."""
        t0 = time.perf_counter()
        keys = self.graph_keys() if keys is None else keys
        self._static_buffers(self.sizes[-1])
        pool = None
        for n, s in keys:
            meta = self._static_meta(n, s)
            self.model(self.ids[:n], self.pos[:n], self.kv_caches, meta)  # lazy init outside the capture
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self.model(self.ids[:n], self.pos[:n], self.kv_caches, meta)
            pool = graph.pool()
            self.graphs[(n, s)] = (graph, out)
        torch.cuda.synchronize(self.device)
        log.info("CUDA graphs: %d decode graphs (batch sizes %s x split buckets %s) captured in %.1f s "
                 "(--enforce-eager skips them)", len(keys), ",".join(map(str, self.sizes)),
                 ",".join(map(str, self.buckets)), time.perf_counter() - t0)

    def run_model(self, inp: StepInputs) -> torch.Tensor:
        meta = inp.meta
        n = meta.num_seqs
        one_token_each = meta.num_decodes == n and inp.input_ids.shape[0] == n  # (no draft rows)
        width = meta.block_tables.shape[1]
        # every sequence decodes: the step's max_seq_len (a host int) is its longest decode
        key = graph_key(n, meta.max_seq_len, self.window, self.sizes, self.buckets) \
            if self.graphs and one_token_each and width <= self.width else None
        if key is None:
            return super().run_model(inp)
        size = key[0]
        self.ids[:n].copy_(inp.input_ids)
        self.pos[:n].copy_(inp.positions)
        self.slots[:n].copy_(meta.slot_mapping)
        self.slots[n:size].fill_(-1)
        self.lens[:n].copy_(meta.seq_lens)
        self.lens[n:size].zero_()
        self.tables[:n, :width].copy_(meta.block_tables)
        graph, out = self.graphs[key]
        graph.replay()
        return out[:n]
