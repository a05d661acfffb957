"""The Worker: the one object between the device-agnostic engine and a device.

A platform makes it (``Platform.worker_cls()``); the engine asks the Platform
nothing else about the device but what it can do (dtypes, capabilities,
memory). It drives the worker through these calls, in this order:

    worker = platform.worker_cls()(platform, rank, world_size, group)   # group: core/engine/distributed/group.py
    worker.init_device(threads_bind=...)        # bind threads / pick the device
    mode = worker.linear_activations(setting)   # packed-weight kernels: their activations, or None
    kv = worker.kv_cache_dtype(choice, dtype, mode)
    worker.load_model(config, weights, dtype, block_size, mode, attention_backend, kv)
    n = worker.determine_num_blocks(requested_bytes, max_model_len, max_num_seqs, max_num_batched_tokens)
    worker.init_kv_cache(n)                     # KV memory, through the attention backend
    worker.warm_up()
    result = worker.execute(scheduler_output, block_tables)   # every step (rank 0)
    worker.follow()                             # ranks > 0: run rank 0's steps until it ends
    worker.shutdown()                           # rank 0: end the group

What differs per device is a handful of hooks: what runs there
(``attention_backend_cls``, ``linear_activations`` / ``packed_linear``,
``kv_cache_dtype``, ``argmax``, ``startup_summary``) and how the model runs
(``layer_ops``: faster elementwise ops; ``stack_runner``: a whole-stack
runner; ``profile_peak_bytes``: a worst-case step's memory, where the device
can measure it). The generic worker runs the plain torch model with the
pure-torch reference attention, on any torch device. The sizing itself,
profile -> budget -> blocks, lives here once.

Tensor parallelism (docs/distributed.md): each rank has a worker, built
with the rank group (core/engine/distributed/group.py), its shard of the weights
and a KV pool holding only its heads. ``agree_num_blocks`` makes every rank
use the smallest count any rank can hold, so block ids mean the same on
every rank; rank 0's ``execute`` broadcasts each step's host batch, and the
other ranks run it in ``follow``. The whole-stack runner is off under
tensor parallelism (the collectives sit between its layers).
"""

from __future__ import annotations

import functools
import logging

import torch

from paged.core.engine.distributed.group import RankGroup
from paged.core.engine.distributed.layout import RankFailed
from paged.core.engine.distributed.parallel_ops import TensorParallelOps
from paged.core.engine.distributed.sharding import local_config, plan_shards, shard_weights
from paged.core.engine.model_runner import ModelRunner, StepResult
from paged.core.models.layers import TorchLayerOps
from paged.core.engine.scheduler import SchedulerOutput

log = logging.getLogger("paged.engine")


def blocks_for_budget(budget_bytes: int, bytes_per_block: int) -> int:
    """How many KV blocks fit in ``budget_bytes``; ValueError naming the
    values when not even one does."""
    if bytes_per_block <= 0:
        raise ValueError(f"bytes_per_block: expected > 0, got {bytes_per_block}")
    if budget_bytes < bytes_per_block:
        raise ValueError(f"KV cache budget: expected at least one block ({bytes_per_block} bytes), "
                         f"got {budget_bytes} bytes")
    return budget_bytes // bytes_per_block


def cap_num_blocks(fit: int, block_size: int, max_model_len: int, max_num_seqs: int,
                   budget_bytes: int | None = None) -> int:
    """What the budget holds (``fit`` blocks), but no more than every running
    sequence at full context length could ever use; ValueError when one
    sequence of max_model_len does not fit (preemption could not progress)."""
    per_seq = -(-max_model_len // block_size)
    num_blocks = int(min(fit, per_seq * max_num_seqs))
    if num_blocks < per_seq:
        budget = "" if budget_bytes is None else f" ({budget_bytes / 2**30:.3f} GiB)"
        raise ValueError(
            f"the KV cache budget{budget} holds {fit} blocks of {block_size} tokens, "
            f"fewer than one sequence of max_model_len={max_model_len} needs ({per_seq}); "
            "raise --kv-cache-memory or lower --max-model-len")
    return num_blocks


class Worker:
    """Runs the model on one device (one rank). Generic: torch layer ops, no
    stack runner, no profiling; a platform subclasses it to change that."""

    def __init__(self, platform, rank: int = 0, world_size: int = 1, group: RankGroup | None = None):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank: expected 0 <= rank < world_size ({world_size}), got {rank}")
        self.platform = platform
        self.rank, self.world_size = rank, world_size
        self.group = group or RankGroup(rank, world_size)
        if world_size > 1 and self.group.comm is None:
            raise ValueError(f"group: expected a joined rank group for world_size {world_size}, got none")
        self.model = self.backend = self.runner = None
        self.shard = None
        self.num_layers = 0

    @functools.cached_property
    def device(self) -> torch.device:
        """This rank's torch device (resolved on first use: a worker made only
        to ask what runs on a device needs no device runtime)."""
        return self.platform.torch_device(self.group.local_rank)

    # -- what runs on this device: a platform's worker overrides these -------
    def attention_backend_cls(self):
        """The AttentionBackend subclass (backends/base.py) the model attends
        with. The generic worker runs the pure-torch reference backend, so a
        platform without kernels of its own runs on any torch device."""
        from paged.backends.reference.attention import ReferenceBackend  # the oracle: no device library

        return ReferenceBackend

    def select_attention_backend(self, choice: str | None = None):
        """--attention-backend ``choice``: None = this worker's own,
        "reference" = the pure-torch oracle."""
        if choice == "reference":
            return Worker.attention_backend_cls(self)
        return self.attention_backend_cls()

    def linear_activations(self, setting: str = "auto") -> str | None:
        """What --linear-activations ``setting`` runs here ("float32",
        "int8", ...), or None when this device has no kernels for packed
        weights (the loader then dequantizes them)."""
        return None

    def packed_linear(self, activations: str):
        """A callable wrapping a loader's PackedBlocks as a weight with
        ``linear(x, bias)`` in ``activations`` (linear_activations' answer)."""
        raise NotImplementedError(f"{type(self).__name__} has no packed-weight kernels")

    #: --kv-cache-dtype names the attention kernels store besides the model
    #: dtype (torch dtype names, or "fp8_e4m3" for float8_e4m3fn; "int8" and
    #: "fp8_e4m3": backends/base.py's quantized rows)
    extra_kv_cache_dtypes: tuple = ()

    def kv_cache_dtype(self, choice: str | None, model_dtype, linear_activations: str | None = None):
        """The torch dtype the KV cache stores for --kv-cache-dtype ``choice``
        (auto / None: ``auto_kv_cache_dtype``); ValueError, one line, for one
        this device does not run."""
        if choice in (None, "auto"):
            return self.auto_kv_cache_dtype(model_dtype, linear_activations)
        # fp8_e4m3 names torch.float8_e4m3fn (rows with a scale, like int8)
        dtype = torch.float8_e4m3fn if choice == "fp8_e4m3" else getattr(torch, str(choice), None)
        if dtype == model_dtype:
            return dtype
        if not isinstance(dtype, torch.dtype) or str(choice) not in self.extra_kv_cache_dtypes:
            model = str(model_dtype).removeprefix("torch.")
            allowed = ", ".join(["auto", model, *(d for d in self.extra_kv_cache_dtypes if d != model)])
            raise ValueError(f"--kv-cache-dtype on {self.platform.name}: expected one of {allowed} "
                             f"(the {model} model's own dtype or what its kernels implement), got {choice!r}")
        return dtype

    def auto_kv_cache_dtype(self, model_dtype, linear_activations: str | None = None):
        """--kv-cache-dtype auto: the model dtype unless the device knows better."""
        return model_dtype

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Greedy tokens: int64 [N], the first index of each row's maximum of
        ``logits`` [N, V], exactly as torch.argmax (a NaN counts as the
        maximum): the sampler's argmax."""
        return logits.argmax(dim=-1)

    def startup_summary(self) -> str:
        """One line for the engine's start-up log: threads, devices and the
        kernel builds in use (empty when there is nothing to add)."""
        return ""

    # -- hooks of the model's execution ----------------------------------------
    def layer_ops(self, dtype: torch.dtype) -> TorchLayerOps:
        """The elementwise ops the model runs (same interface as TorchLayerOps)."""
        return TorchLayerOps()

    def stack_runner(self, model):
        """An object with ``accepts(ops)``, ``handles(num_tokens)`` and
        ``run(hidden, rope_in, kv_caches, meta)`` that runs every decoder
        layer of a step at once, or None."""
        return None

    def profile_peak_bytes(self, num_tokens: int) -> int | None:
        """Device memory a worst-case step of ``num_tokens`` needs at its peak
        (weights included), or None where the platform reads what is in use
        when it sizes the budget (the CPU: host memory after loading)."""
        return None

    def agree_num_blocks(self, num_blocks: int) -> int:
        """The count every rank uses: the minimum over ranks (tensor
        parallelism reduces it over the group; one rank keeps its own)."""
        if self.world_size == 1:
            return num_blocks
        return self.group.min_int(num_blocks)

    # -- lifecycle ------------------------------------------------------------
    def init_device(self, **options) -> None:
        """Prepare this rank's device (the CPU binds threads and memory)."""
        # placement is per machine: the rank and rank count on this one
        self.platform.init(rank=self.group.local_rank, world_size=self.group.local_world_size, **options)

    def load_model(self, config, weights: dict, dtype: torch.dtype, block_size: int,
                   linear_activations: str | None = None, attention_backend: str | None = None,
                   kv_cache_dtype: torch.dtype | None = None):
        """Builds the attention backend (--attention-backend ``attention_backend``)
        and the model from loaded weights (a tensor-parallel rank: its shard
        of them), packed matrices in ``linear_activations`` (None: weights
        came dense), then picks the layer ops and the stack runner."""
        from paged.core.models import build_model

        parallel = None
        if self.world_size > 1:
            self.shard = plan_shards(config, self.world_size)[self.rank]
            weights = shard_weights(weights, config, self.shard)
            config = local_config(config, self.shard)
            parallel = TensorParallelOps(self.group.comm, self.shard)
            log.info("tensor parallel %d ranks (%s, %s): %s", self.world_size, self.group.launcher,
                     self.group.backend, self.shard.describe())
        packed_linear = None if linear_activations is None else self.packed_linear(linear_activations)
        self.backend = self.select_attention_backend(attention_backend)(config.num_heads, config.num_kv_heads, config.head_dim, block_size,
                                   dtype, self.device, sliding_window=config.sliding_window,
                                   kv_cache_dtype=kv_cache_dtype)
        self.model = build_model(config, weights, dtype, self.device, self.backend, packed_linear, parallel)
        self.num_layers = config.num_layers
        self.prepare_model(self.model)
        return self.model

    def prepare_model(self, model) -> None:
        """Hands ``model`` this worker's layer ops and stack runner."""
        model.ops = self.layer_ops(model.dtype)
        # off under tensor parallelism: the collectives sit between its layers
        model.layer_stack = self.stack_runner(model) if self.world_size == 1 else None

    @property
    def bytes_per_block(self) -> int:
        return self.backend.bytes_per_block(self.num_layers)

    def kv_cache_committed_bytes(self) -> int | None:
        """Bytes of the KV cache committed now where the backend commits it
        as it is used (its ``kv_memory``: the CPU's); None: all of it,
        allocated up front."""
        memory = getattr(self.backend, "kv_memory", None)
        return None if memory is None else memory.committed_bytes()

    def determine_num_blocks(self, requested_bytes: int | None, max_model_len: int, max_num_seqs: int,
                             max_num_batched_tokens: int) -> int:
        """Profile -> budget -> blocks: the peak of a worst-case step (where
        measured), the platform's budget for the KV cache given that peak
        and ``requested_bytes`` (--kv-cache-memory), the blocks it holds
        agreed across ranks, capped at what the sequences can use."""
        peak = self.profile_peak_bytes(max_num_batched_tokens)
        budget = self.platform.kv_cache_budget_bytes(requested_bytes, profiled_peak_bytes=peak)
        fit = self.agree_num_blocks(blocks_for_budget(budget, self.bytes_per_block))
        return cap_num_blocks(fit, self.backend.block_size, max_model_len, max_num_seqs, budget)

    def init_kv_cache(self, num_blocks: int) -> None:
        """Allocates the KV memory (through the attention backend, which
        decides where it lives) and the step runner over it."""
        self.runner = ModelRunner(self.model, self.backend, self.num_layers, num_blocks,
                                  self.backend.block_size, self.device)

    def warm_up(self) -> None:
        self.runner.warm_up()

    def execute(self, out: SchedulerOutput, block_tables: list[list[int]]) -> StepResult:
        """One step: ``block_tables`` holds each scheduled sequence's blocks.
        Tensor parallel (rank 0): the step's host batch goes to every rank
        first; a rank that died is a RankFailed naming it."""
        if self.world_size == 1:
            return self.runner.execute(out, block_tables)
        if self.group.stopped:
            raise RankFailed(self.group.stopped)
        inp = self.runner.build_inputs(out, block_tables)
        try:
            self.group.broadcast_object(inp.batch)
            return self.runner.run(inp)
        except Exception as exc:  # noqa: BLE001 - the other ranks are inside this step: the group cannot go on
            error = self.group.failure(exc)
            self.group.shutdown(grace_s=0)
            raise error from exc

    def follow(self) -> None:
        """A tensor-parallel rank other than 0: runs rank 0's steps until it
        sends the end (None); RankFailed when rank 0 is gone."""
        while True:
            try:
                batch = self.group.broadcast_object()
            except RuntimeError as exc:
                raise RankFailed(f"rank {self.rank}: rank 0 left the group ({str(exc).splitlines()[0][:200]})") \
                    from exc
            if batch is None:
                return
            self.platform.bind_thread()
            self.runner.run(self.runner.inputs_from(batch))

    def shutdown(self) -> None:
        """Rank 0: tells the other ranks to stop, then ends the group."""
        if self.world_size > 1 and self.group.comm is not None and self.rank == 0:
            try:
                self.group.broadcast_object(None)
            except RuntimeError:  # a rank already gone: nothing to tell it
                pass
        self.group.shutdown()
