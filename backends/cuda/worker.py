"""The CUDA worker: the generic Worker (core/engine/worker.py) with the GPU's
profiling and CUDA graphs.

- profiling (``profile_peak_bytes``): a worst-case step, every token of
  --max-num-batched-tokens spread over as many prompts as --max-num-seqs
  allows (the most activation rows and the most logits rows at once), runs
  through the real model over a temporary KV cache; torch's peak allocation
  (weights included) plus the memory outside torch's allocator is what the
  step needs. CudaPlatform.kv_cache_budget_bytes then gives the KV cache
  ``--gpu-memory-utilization x total - that peak`` (an error naming the flag
  when nothing is left) and logs the numbers.
- CUDA graphs for decode steps (backends/cuda/graphs.py), captured once the
  cache exists, unless --enforce-eager. Their memory pool is not part of
  the profile: it comes out of the (1 - utilization) headroom.
"""

from __future__ import annotations

import gc
import logging

import torch

from paged.backends.cuda.graphs import CudaGraphRunner
from paged.core.engine.model_runner import ModelRunner
from paged.core.engine.request import Request
from paged.core.engine.sampling_params import SamplingParams
from paged.core.engine.scheduler import ScheduledSeq, SchedulerOutput
from paged.core.engine.worker import Worker
from paged.platforms.sizes import format_size

__all__ = ["CudaWorker", "profile_seq_lens"]

log = logging.getLogger("paged.engine")


def profile_seq_lens(num_tokens: int, max_num_seqs: int, max_model_len: int | None = None) -> list[int]:
    """The prompts of the profiling step: ``num_tokens`` tokens over
    min(max_num_seqs, num_tokens) prompts, lengths differing by at most one,
    none longer than ``max_model_len`` (fewer tokens when they do not fit)."""
    for name, value in (("num_tokens", num_tokens), ("max_num_seqs", max_num_seqs)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: expected a positive integer, got {value!r}")
    n = min(max_num_seqs, num_tokens)
    base, extra = divmod(num_tokens, n)
    lens = [base + (i < extra) for i in range(n)]
    return [min(x, max_model_len) for x in lens] if max_model_len else lens


class CudaWorker(Worker):
    max_num_seqs = 64
    enforce_eager = False
    max_model_len: int | None = None

    def attention_backend_cls(self):
        from paged.backends.cuda.attention import CudaBackend  # imports torch.cuda only when a model loads

        return CudaBackend

    def init_device(self, max_num_seqs: int = 64, enforce_eager: bool = False, **options) -> None:
        self.max_num_seqs, self.enforce_eager = int(max_num_seqs), bool(enforce_eager)
        super().init_device(device=self.device.index, **options)

    def determine_num_blocks(self, requested_bytes, max_model_len, max_num_seqs, max_num_batched_tokens):
        self.max_model_len, self.max_num_seqs = max_model_len, max_num_seqs
        return super().determine_num_blocks(requested_bytes, max_model_len, max_num_seqs, max_num_batched_tokens)

    @torch.inference_mode()
    def profile_peak_bytes(self, num_tokens: int) -> int:
        lens = profile_seq_lens(num_tokens, self.max_num_seqs, self.max_model_len)
        bs = self.backend.block_size
        tables, first = [], 0
        for n in lens:
            tables.append(list(range(first, first + -(-n // bs))))
            first += len(tables[-1])
        gc.collect()
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        weights = torch.cuda.memory_allocated(self.device)
        runner = ModelRunner(self.model, self.backend, self.num_layers, first, bs, self.device)
        entries = [ScheduledSeq(Request(f"profile-{i}", None, [0] * n, SamplingParams(max_tokens=1)).seqs[0], 0, n)
                   for i, n in enumerate(lens)]
        inp = runner.build_inputs(SchedulerOutput(prefills=entries), tables)
        hidden = runner.run_model(inp)
        logits = self.model.compute_logits(hidden.index_select(0, torch.from_numpy(inp.sample_rows).to(self.device)))
        torch.cuda.synchronize(self.device)
        del runner, inp, hidden, logits  # the temporary cache (outside torch's allocator) goes too
        gc.collect()
        self.backend.num_blocks = None
        peak = self.platform.used_after_profiling_bytes()
        log.info("profiled a step of %d tokens in %d prompts: %s at the peak (weights %s, peak allocated %s)",
                 sum(lens), len(lens), format_size(peak), format_size(weights),
                 format_size(torch.cuda.max_memory_allocated(self.device)))
        return peak

    def init_kv_cache(self, num_blocks: int) -> None:
        if self.enforce_eager:
            super().init_kv_cache(num_blocks)
            return
        self.runner = CudaGraphRunner(self.model, self.backend, self.num_layers, num_blocks,
                                      self.backend.block_size, self.device, self.max_num_seqs, self.max_model_len)
        self.runner.capture()
