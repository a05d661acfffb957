"""The worker of an accelerator with memory of its own (CudaWorker,
NpuWorker): the generic Worker (core/engine/worker.py) whose KV cache is
sized from a profiled worst-case step, per engine instance (memory.py).

``profile_peak_bytes`` runs every token of --max-num-batched-tokens spread
over as many prompts as --max-num-seqs allows (``profile_seq_lens``: the
most activation rows and the most logits rows at once) through the real
model over a temporary KV cache, then reads what this instance uses at the
peak (weights, activations, growth outside torch's allocator since the
platform's baseline) and adds ``held_bytes()``: what a platform keeps
allocated beside the KV cache for the whole run (CUDA: the graphs' pool and
static buffers, the split-K workspace). The platform turns that into the KV
budget (InstanceMemory.kv_cache_budget_bytes).
"""

from __future__ import annotations

import logging

import torch

from paged.core.engine.model_runner import ModelRunner
from paged.core.engine.request import Request
from paged.core.engine.sampling_params import SamplingParams
from paged.core.engine.scheduler import ScheduledSeq, SchedulerOutput
from paged.core.engine.worker import Worker
from paged.platforms.sizes import format_size

__all__ = ["AcceleratorWorker", "profile_seq_lens"]

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


class AcceleratorWorker(Worker):
    max_num_seqs = 64
    #: the longest sequence the engine allows (determine_num_blocks), else the model's context
    max_model_len: int | None = None
    model_max_len: int | None = None

    def init_device(self, max_num_seqs: int = 64, **options) -> None:
        self.max_num_seqs = int(max_num_seqs)
        super().init_device(**options)

    def load_model(self, config, *args, **kwargs):
        # the bound on a sequence when the engine never calls determine_num_blocks (--num-kv-blocks)
        self.model_max_len = int(config.max_position_embeddings)
        return super().load_model(config, *args, **kwargs)

    def longest_sequence(self, num_blocks: int) -> int:
        """Tokens of the longest sequence a cache of ``num_blocks`` can hold
        for this engine: --max-model-len when the engine passed it, else the
        model's context, never more than the cache."""
        limit = self.max_model_len or self.model_max_len or num_blocks * self.backend.block_size
        return min(int(limit), num_blocks * self.backend.block_size)

    def determine_num_blocks(self, requested_bytes, max_model_len, max_num_seqs, max_num_batched_tokens):
        self.max_model_len, self.max_num_seqs = max_model_len, max_num_seqs
        return super().determine_num_blocks(requested_bytes, max_model_len, max_num_seqs, max_num_batched_tokens)

    def held_bytes(self) -> int:
        """Device memory kept beside the KV cache for the whole run and not
        in the profiled step's peak (a platform's override measures it)."""
        return 0

    @torch.inference_mode()
    def profile_step(self, num_tokens: int) -> list[int]:
        """Runs the worst-case step of ``num_tokens`` tokens through the model
        over a temporary KV cache (freed after); returns its prompt lengths.
        The peak statistics were reset just before it ran."""
        mem = self.platform.device_memory()
        lens = profile_seq_lens(num_tokens, self.max_num_seqs, self.max_model_len)
        bs = self.backend.block_size
        tables, first = [], 0
        for n in lens:
            tables.append(list(range(first, first + -(-n // bs))))
            first += len(tables[-1])
        mem.settle()
        mem.reset_peak()
        runner = ModelRunner(self.model, self.backend, self.num_layers, first, bs, self.device)
        entries = [ScheduledSeq(Request(f"profile-{i}", None, [0] * n, SamplingParams(max_tokens=1)).seqs[0], 0, n)
                   for i, n in enumerate(lens)]
        inp = runner.build_inputs(SchedulerOutput(prefills=entries), tables)
        hidden = runner.run_model(inp)
        self.model.compute_logits(hidden.index_select(0, inp.device_sample_rows))
        mem.module.synchronize(mem.index)
        del runner, inp, hidden  # the temporary cache goes too
        mem.settle()
        self.backend.num_blocks = None
        return lens

    def profile_peak_bytes(self, num_tokens: int) -> int:
        """This instance's use at its profiled peak plus held_bytes(). A
        platform whose device keeps no statistics (the simulated NPU: host
        tensors) has nothing to measure: the step is not run."""
        mem = self.platform.device_memory()
        lens = self.profile_step(num_tokens) if self.platform.profiles_memory else []
        step = self.platform.used_after_profiling_bytes()
        held = self.held_bytes()
        log.info("profiled a step of %d tokens in %d prompts: %s used at the peak (peak allocated %s) + %s held "
                 "beside the KV cache", sum(lens), len(lens), format_size(step), format_size(mem.peak_allocated()),
                 format_size(held))
        return step + held
