"""CUDA sizing, launch sizes and the per-step path, on the CPU (no GPU
needed): the profiling step's shape, the per-instance memory accounting
(two instances at 0.45 both start; what stays beside the KV cache is
counted), the --gpu-memory-utilization / --enforce-eager options, the
decode launch sized by the step's real lengths (graph buckets, eager
workspaces), and the per-step path's host<->device traffic, checked over
tensors on torch's "meta" device (an EMULATED device: its data cannot be
read, so any device->host copy raises). The GPU side (a real profile, graph
replay equal to eager) is in .ci/gpu_check.sh and tests/test_cuda_backend.py."""

from __future__ import annotations

import argparse
import dataclasses
import types

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode

from paged.backends.accelerator.memory import (MemorySnapshot, check_share_fits, instance_used_bytes,
                                               kv_budget_line, kv_cache_budget)
from paged.backends.cuda import launch
from paged.backends.cuda.graphs import MAX_GRAPH_WORKSPACE, capture_sizes, graph_key, padded_size
from paged.backends.cuda.worker import eager_workspace_bytes, profile_seq_lens
from paged.core.engine.config import EngineConfig, add_engine_args, engine_config_from_args

GiB = 2**30


def test_profile_step_spreads_the_token_budget_over_the_most_sequences():
    assert profile_seq_lens(512, 64) == [8] * 64
    assert profile_seq_lens(10, 4) == [3, 3, 2, 2]
    assert profile_seq_lens(3, 64) == [1, 1, 1]  # never an empty prompt
    assert profile_seq_lens(8192, 1, max_model_len=2048) == [2048]
    for tokens, seqs in [(512, 64), (1000, 7), (7, 1), (2048, 256)]:
        lens = profile_seq_lens(tokens, seqs)
        assert sum(lens) == tokens and len(lens) == min(tokens, seqs) and max(lens) - min(lens) <= 1
    with pytest.raises(ValueError, match="max_num_seqs: expected a positive integer, got 0"):
        profile_seq_lens(512, 0)


# -- memory: per engine instance ------------------------------------------------------
def test_used_bytes_count_this_instance_only():
    # 141 GiB device; at start another process holds 60 GiB and this CUDA context 0.5 GiB
    base = MemorySnapshot(total=141 * GiB, free=int(80.5 * GiB), reserved=0)
    # after profiling: torch reserved 9 GiB (peak allocated 8), cuBLAS grew outside torch by 1 GiB
    now = MemorySnapshot(total=141 * GiB, free=int(70.5 * GiB), reserved=9 * GiB)
    assert instance_used_bytes(base, now, peak_allocated=8 * GiB) == 9 * GiB  # not the other 60 GiB
    assert instance_used_bytes(base, now, 8 * GiB, held_bytes=2 * GiB) == 11 * GiB
    assert instance_used_bytes(now, base, 0) == 0  # memory released outside torch is never negative
    budget = kv_cache_budget(141 * GiB, 9 * GiB, 0.45)
    assert budget == int(0.45 * 141 * GiB) - 9 * GiB
    line = kv_budget_line(141 * GiB, 9 * GiB, 0.45, budget)
    assert line.startswith("KV cache budget: --gpu-memory-utilization 0.45 x 141.00 GiB = 63.45 GiB")
    assert "9.00 GiB used at the profiled peak -> 54.45 GiB for the KV cache" in line


class _Device:
    """An EMULATED GPU shared by several engine instances (torch.cuda's
    memory API): what each one allocates is visible to the others only as
    less free memory."""

    def __init__(self, total: int, context: int = GiB // 2):
        self.total, self.used_by = total, {}
        self.context = context

    def module(self, name: str):
        dev = self
        self.used_by.setdefault(name, {"allocated": 0, "peak": 0, "outside": dev.context})

        def allocate(n):
            u = dev.used_by[name]
            u["allocated"] += n
            u["peak"] = max(u["peak"], u["allocated"])
        ns = types.SimpleNamespace(
            mem_get_info=lambda i=0: (dev.total - sum(u["allocated"] + u["outside"] for u in dev.used_by.values()),
                                      dev.total),
            memory_reserved=lambda i=0: dev.used_by[name]["allocated"],
            memory_allocated=lambda i=0: dev.used_by[name]["allocated"],
            max_memory_allocated=lambda i=0: dev.used_by[name]["peak"],
            reset_peak_memory_stats=lambda i=0: dev.used_by[name].update(peak=dev.used_by[name]["allocated"]),
            synchronize=lambda i=0: None, empty_cache=lambda: None, allocate=allocate)
        return ns


def _instance(device: _Device, name: str, utilization: float):
    from paged.backends.accelerator.memory import DeviceMemory
    from paged.platforms.cuda import CudaPlatform

    module = device.module(name)

    class OnEmulatedGpu(CudaPlatform):
        def device_memory(self):
            return DeviceMemory(module, 0)

    p = OnEmulatedGpu()
    p.start_accounting(utilization)  # what CudaPlatform.init does once the device is selected
    return p, module


def test_two_instances_at_045_both_start_and_size_their_share():
    """vLLM's rule: --gpu-memory-utilization is one instance's share. The
    second engine does not count the first one's weights and KV cache as its
    own (before: used = everything outside its allocator, other processes
    included, so the second engine at 0.45 had no room)."""
    gpu = _Device(141 * GiB)
    budgets = []
    for name in ("first", "second"):
        platform, mem = _instance(gpu, name, 0.45)
        mem.allocate(8 * GiB)  # weights
        mem.reset_peak_memory_stats()
        mem.allocate(3 * GiB)  # the profiled step's activations, then freed
        mem.allocate(-3 * GiB)
        budget = platform.kv_cache_budget_bytes(profiled_peak_bytes=platform.used_after_profiling_bytes(GiB))
        assert budget == int(0.45 * 141 * GiB) - (11 + 1) * GiB  # weights + activations + 1 GiB held
        mem.allocate(budget)  # its KV cache
        budgets.append(budget)
    with pytest.raises(ValueError) as e:  # a third share is not free
        _instance(gpu, "third", 0.45)
    msg = str(e.value)
    assert msg.startswith("--gpu-memory-utilization 0.45: expected the 63.45 GiB share of the device's 141.00 GiB "
                          "to be free at start") and "\n" not in msg and ", got " in msg


def test_share_check_and_budget_errors_name_the_flag():
    check_share_fits(100 * GiB, 50 * GiB, 0.5)
    with pytest.raises(ValueError, match=r"--gpu-memory-utilization 0.60: expected the 60.00 GiB share .* "
                                         r"got 50.00 GiB free"):
        check_share_fits(100 * GiB, 50 * GiB, 0.6)
    with pytest.raises(ValueError) as e:
        kv_cache_budget(16 * GiB, 15 * GiB, 0.9)
    msg = str(e.value)
    assert "--gpu-memory-utilization 0.90" in msg and "no room for the KV cache" in msg and "\n" not in msg


def test_what_stays_beside_the_kv_cache_is_profiled():
    """The profile adds what the worker holds for the whole run (CUDA: the
    graphs' pool and static buffers, measured; eager: the split-K workspace
    of the largest batch at the longest sequence): before, neither was in
    the budget."""
    from paged.backends.accelerator.worker import AcceleratorWorker

    assert eager_workspace_bytes(64, 32, 128, 32768) == 64 * 32 * 64 * (128 + 2) * 4
    assert eager_workspace_bytes(64, 32, 128, 512) == 0  # one partition: no workspace
    assert eager_workspace_bytes(64, 32, 128, 32768, sliding_window=4096) == 64 * 32 * 8 * 130 * 4

    class Platform:  # the accounting's inputs: 5 GiB used at the step's peak
        profiles_memory = False

        def device_memory(self):
            return types.SimpleNamespace(peak_allocated=lambda: 0)

        def used_after_profiling_bytes(self, held_bytes=0):
            return 5 * GiB + held_bytes

    class Worker(AcceleratorWorker):
        def held_bytes(self):
            return 3 * GiB

    w = Worker.__new__(Worker)
    w.platform = Platform()
    assert w.profile_peak_bytes(512) == 8 * GiB


def _parse(*argv):
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return engine_config_from_args(parser.parse_args(list(argv)))


def test_options_reach_the_engine_config():
    d = _parse()
    assert d.gpu_memory_utilization == 0.9 and d.enforce_eager is False
    c = _parse("--gpu-memory-utilization", "0.5", "--enforce-eager")
    assert c.gpu_memory_utilization == 0.5 and c.enforce_eager is True
    assert EngineConfig(gpu_memory_utilization=1).gpu_memory_utilization == 1.0
    for bad in (0, 1.2, -0.5, "0.9", True):
        with pytest.raises(ValueError, match=r"--gpu-memory-utilization: expected a fraction in \(0, 1\]"):
            EngineConfig(gpu_memory_utilization=bad)


# -- launch sizes ---------------------------------------------------------------------
def test_split_partition_agrees_with_the_kernel():
    try:
        from paged import _C_cuda
    except ImportError:
        pytest.skip("paged._C_cuda not built")
    assert _C_cuda.split_partition == launch.SPLIT_PARTITION
    for blocks, bs, window in [(1, 16, 0), (32, 16, 0), (33, 16, 0), (100, 128, 700), (4, 16, 4096)]:
        assert _C_cuda.decode_max_splits(blocks, bs, window) == launch.decode_splits(blocks * bs, window)


def test_decode_launch_is_sized_by_the_steps_longest_sequence():
    assert [launch.decode_splits(n) for n in (0, 1, 512, 513, 1500, 131072)] == [1, 1, 1, 2, 3, 256]
    assert launch.decode_splits(131072, sliding_window=4096) == 8
    assert launch.split_buckets(256) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert launch.split_buckets(5) == [1, 2, 4, 5] and launch.split_buckets(1) == [1]
    buckets = launch.split_buckets(256)
    assert [launch.bucket_for(s, buckets) for s in (1, 2, 3, 9, 256)] == [1, 2, 4, 16, 256]
    assert launch.bucket_for(257, buckets) is None
    for s in range(1, 257):  # a replay launches at most twice the partitions the step needs
        assert s <= launch.bucket_for(s, buckets) < 2 * s
    with pytest.raises(ValueError, match="max_splits: expected a positive integer, got 0"):
        launch.split_buckets(0)


def test_graph_of_a_short_batch_launches_one_partition():
    """Under CUDA graphs with a 128k context: before, every replay launched
    ceil(131072 / 512) = 256 partitions per (kv head, sequence); now a batch
    of short sequences replays the one-partition graph."""
    sizes = capture_sizes(64)
    buckets = launch.capped_buckets(launch.decode_splits(131072), 64, 32, 128, MAX_GRAPH_WORKSPACE)
    assert graph_key(3, 300, 0, sizes, buckets) == (4, 1)
    assert graph_key(3, 2000, 0, sizes, buckets) == (4, 4)
    assert graph_key(64, 131072, 0, sizes, buckets) == (64, 256)
    assert graph_key(65, 300, 0, sizes, buckets) is None  # more sequences than captured: eager
    # the static workspace is capped: a 1M context captures the buckets that fit, longer steps run eagerly
    capped = launch.capped_buckets(launch.decode_splits(2**20), 64, 32, 128, MAX_GRAPH_WORKSPACE)
    assert capped[-1] < 2048 and launch.workspace_bytes(64, 32, capped[-1], 128) <= MAX_GRAPH_WORKSPACE
    assert graph_key(8, 2**20, 0, sizes, capped) is None


def test_graph_table_is_bounded_by_the_models_context_with_num_kv_blocks():
    """--num-kv-blocks skips determine_num_blocks, which used to leave
    max_model_len None: the block table (and the split buckets) then
    spanned the whole pool (33.5M tokens of pool: grid_z > 65535 at
    capture). The model's context bounds it now."""
    from paged.backends.cuda.worker import CudaWorker

    w = CudaWorker.__new__(CudaWorker)
    w.backend = types.SimpleNamespace(block_size=16)
    w.max_model_len, w.model_max_len = None, 4096
    assert w.longest_sequence(2_100_000) == 4096
    w.max_model_len = 2048
    assert w.longest_sequence(2_100_000) == 2048 and w.longest_sequence(100) == 1600


def test_per_layer_windows_launch_what_each_layers_window_needs():
    """Layers with their own sliding window (Gemma 3's local layers beside
    global ones, core/models/layer_attention.py) on one CudaBackend, whose
    step launch is sized for the widest window (none): each layer launches
    the partitions its own window needs, over the front of the step's
    workspace, never fewer than one of its sequences needs (the kernel's own
    count, ``_C_cuda.decode_max_splits``, is the oracle: fewer writes NaN
    rows). Before, a backend had one window, and a model with several was
    refused at build. Under a graph (a bucket above the step's need) too."""
    from paged.backends.cuda.attention import CudaBackend
    from paged.backends.cuda.metadata import build_step, layer_launch, split_workspace
    from paged.backends.npu.attention import NpuBackend
    from paged.core.models.layer_attention import serves_any_window

    assert serves_any_window(CudaBackend) and serves_any_window(NpuBackend)
    try:
        from paged import _C_cuda

        needs = _C_cuda.decode_max_splits
    except ImportError:
        needs = lambda blocks, bs, w: launch.decode_splits(blocks * bs, w)  # noqa: E731 (its mirror, tested above)
    lens = [9008, 304, 48]  # whole 16-token blocks: a table row's blocks are the sequence's
    common = _decode_step(lens, 16)
    meta = build_step(common, block_size=16, num_heads=8, head_size=64, sliding_window=0, device="cpu",
                      num_blocks=1000, check_ids=True)
    assert meta.decode_splits == 18
    bucket = dataclasses.replace(meta, decode_splits=32, **dict(zip(("split_out", "split_max_sum"),
                                                                   split_workspace(3, 8, 32, 64, "cpu"))))
    for m in (meta, bucket):
        for window in (0, 4096, 1000, 512, 100, 1):
            splits, (out, max_sum) = layer_launch(m, window)
            need = max(needs(n // 16, 16, window) for n in lens)
            assert need <= splits <= m.decode_splits and (splits == need or m is bucket), (window, splits, need)
            if splits > 1:  # the front of the step's workspace, as the kernel's shapes want
                assert out.shape == (3, 8, splits, 64) and max_sum.shape == (3, 8, splits, 2)
                assert out.is_contiguous() and out.data_ptr() == m.split_out.data_ptr()
        assert layer_launch(m, 1000)[0] == 2 and layer_launch(m, 0)[0] == m.decode_splits
    narrow = build_step(common, block_size=16, num_heads=8, head_size=64, sliding_window=1000, device="cpu",
                        num_blocks=1000, check_ids=True)
    with pytest.raises(ValueError, match="sliding_window of a layer: expected at most the 1000 the step's decode "
                                         "launch was sized for, got none"):
        layer_launch(narrow, 0)


def _decode_step(lens: list[int], block_size: int):
    """Decode metadata (CPU tensors) for sequences of these lengths over distinct blocks."""
    from paged.backends.base import AttentionMetadata

    blocks = [-(-n // block_size) for n in lens]
    tables = torch.full((len(lens), max(blocks)), -1, dtype=torch.int32)
    at, slots = 0, []
    for i, (n, b) in enumerate(zip(lens, blocks)):
        tables[i, :b] = torch.arange(at, at + b)
        slots.append((at + (n - 1) // block_size) * block_size + (n - 1) % block_size)
        at += b
    return AttentionMetadata(torch.tensor(slots), torch.arange(len(lens) + 1, dtype=torch.int32),
                             torch.tensor(lens, dtype=torch.int32), tables, num_decodes=len(lens),
                             max_query_len=1, max_seq_len=max(lens))


def test_decode_graph_sizes_and_padding():
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert capture_sizes(5) == [1, 2, 4, 5]
    assert capture_sizes(1) == [1]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    sizes = capture_sizes(64)
    assert [padded_size(n, sizes) for n in (1, 2, 3, 5, 8, 9, 17, 63, 64)] == [1, 2, 4, 8, 8, 16, 24, 64, 64]
    assert padded_size(65, sizes) is None and padded_size(0, sizes) is None
    for n in range(1, 65):  # the padded size covers n with the least waste among the captured sizes
        p = padded_size(n, sizes)
        assert p >= n and all(s < n or s >= p for s in sizes)


# -- the per-step path: no device->host copy, one host->device copy -------------------
class _Calls(TorchFunctionMode):
    """Records Tensor.to / .cpu / .tolist / .item ... calls (name, kwargs)
    on tensors that are not host tensors (host ones cost nothing)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        on_host = bool(args) and isinstance(args[0], torch.Tensor) and args[0].device.type == "cpu"
        if name in ("to", "cpu", "tolist", "item", "numpy") and not (on_host and name != "to"):
            self.calls.append((name, dict(kwargs)))
        return func(*args, **kwargs)


def _host_batch():
    """Two decodes (40 and 1500 tokens) and a 3-token prompt, blocks of 16,
    98 blocks used of a pool of 100."""
    from paged.core.engine.model_runner import HostBatch

    lens = [40, 1500, 3]
    tables = np.zeros((3, 94), dtype=np.int32)
    tables[0, :3], tables[1, :94], tables[2, 0] = [0, 1, 2], np.arange(3, 97), 97
    pos = np.array([39, 1499, 0, 1, 2])
    rows = np.array([0, 1, 2, 2, 2])
    slots = tables[rows, pos // 16].astype(np.int64) * 16 + pos % 16
    return HostBatch(np.array([5, 6, 7, 8, 9], dtype=np.int64), pos.astype(np.int64), slots,
                     np.array([0, 1, 2, 5], dtype=np.int32), np.array(lens, dtype=np.int32), tables, 2,
                     np.array([0, 1, 4], dtype=np.int64), 2)


def test_runner_sends_a_step_in_one_nonblocking_copy(monkeypatch):
    """Every array of a step goes to the device in ONE copy, from a staging
    buffer asked for page-locked where the runtime can pin, with
    non_blocking=True (before: six synchronous copies from pageable memory,
    each waiting for the device's queued work). "meta" EMULATES the device."""
    from paged.backends.reference.attention import ReferenceBackend
    from paged.core.engine import model_runner as mr

    asked = []

    def staging(nbytes):  # this CPU-only torch cannot pin: record the request instead
        asked.append(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8)

    monkeypatch.setattr(mr, "_staging_buffer", staging)
    be = ReferenceBackend(4, 2, 64, 16, torch.float16, "meta")
    runner = mr.ModelRunner(None, be, 1, 100, 16, torch.device("meta"))
    with _Calls() as rec:
        inp = runner.inputs_from(_host_batch())
    assert [c for c in rec.calls if c[0] == "to"] == [("to", {"non_blocking": True})]
    assert not [c for c in rec.calls if c[0] in ("cpu", "tolist", "item")]
    assert len(asked) == 1
    assert inp.meta.host is not None and inp.input_ids.device.type == "meta"
    assert (inp.meta.block_tables.shape, inp.meta.block_tables.dtype) == ((3, 94), torch.int32)
    assert inp.device_sample_rows.shape == (3,)


def test_runner_on_the_cpu_makes_no_copy():
    from paged.backends.reference.attention import ReferenceBackend
    from paged.core.engine.model_runner import ModelRunner

    runner = ModelRunner(None, ReferenceBackend(4, 2, 64, 16, torch.float32, "cpu"), 1, 100, 16, torch.device("cpu"))
    b = _host_batch()
    with _Calls() as rec:
        inp = runner.inputs_from(b)
    assert rec.calls == []
    assert inp.meta.slot_mapping.data_ptr() == b.slot_mapping.ctypes.data  # the host array itself
    assert inp.input_ids.data_ptr() == b.input_ids.ctypes.data


def test_cuda_step_metadata_reads_no_device_data():
    """CudaBackend's per-step metadata (block-id checks, launch sizes,
    workspace) from the runner's host arrays: with the index tensors on an
    EMULATED device ("meta": unreadable) it still builds, where the old
    check_step_ids copied four tensors back (.cpu(), a sync each)."""
    from paged.backends.cuda.metadata import build_step
    from paged.core.engine.model_runner import StepMetadata, to_device

    b = _host_batch()
    t = to_device({"slot_mapping": b.slot_mapping, "query_start_loc": b.query_start_loc, "seq_lens": b.seq_lens,
                   "block_tables": b.block_tables}, torch.device("meta"))
    common = StepMetadata(**t, num_decodes=2, max_query_len=3, max_seq_len=1500, host=b)
    kw = dict(block_size=16, num_heads=8, head_size=128, sliding_window=0, device="meta", check_ids=True)
    with _Calls() as rec:
        meta = build_step(common, num_blocks=100, **kw)
    assert not [c for c in rec.calls if c[0] in ("cpu", "tolist", "item", "to")]
    assert meta.decode_splits == 3  # the longest decode (1500 tokens)
    assert meta.split_out.shape == (2, 8, 3, 128) and meta.split_max_sum.shape == (2, 8, 3, 2)
    b.block_tables[1, 5] = 140  # a stray id is still caught, on the host
    with pytest.raises(IndexError, match=r"block_tables\[1, 5\]: expected a block id in \[0, 100\), got 140"):
        build_step(common, num_blocks=100, **kw)
    short = build_step(StepMetadata(**t, num_decodes=1, max_query_len=3, max_seq_len=1500, host=b),
                       num_blocks=None, **kw)
    assert short.decode_splits == 1 and short.split_out.numel() == 0  # one 40-token decode: no split
