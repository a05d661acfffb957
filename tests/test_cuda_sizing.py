"""CUDA sizing and graph arithmetic, on the CPU (no GPU needed): the
profiling step's shape, the memory figures the budget is computed from, the
--gpu-memory-utilization / --enforce-eager options, and the padded batch
sizes of the decode graphs. The GPU side (a real profile, graph replay equal
to eager) is in .ci/gpu_check.sh and tests/test_cuda_backend.py."""

from __future__ import annotations

import argparse

import pytest

from paged.backends.cuda.graphs import capture_sizes, padded_size
from paged.backends.cuda.worker import profile_seq_lens
from paged.core.engine.config import EngineConfig, add_engine_args, engine_config_from_args
from paged.platforms.cuda import device_used_bytes, kv_budget_line, kv_cache_budget

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


def test_used_bytes_and_budget_from_the_profile():
    # 141 GiB device, 130 GiB free, torch holds 9 GiB reserved: 2 GiB outside torch (context, others)
    used = device_used_bytes(141 * GiB, 130 * GiB, 9 * GiB, peak_allocated_bytes=8 * GiB)
    assert used == 10 * GiB
    assert device_used_bytes(10 * GiB, 10 * GiB, 1 * GiB, 0) == 0  # never negative
    budget = kv_cache_budget(141 * GiB, used, 0.9)
    assert budget == int(0.9 * 141 * GiB) - 10 * GiB
    line = kv_budget_line(141 * GiB, used, 0.9, budget)
    assert line.startswith("KV cache budget: --gpu-memory-utilization 0.90 x 141.00 GiB = 126.90 GiB")
    assert "10.00 GiB used at the profiled peak -> 116.90 GiB for the KV cache" in line


def test_nothing_left_names_the_flag():
    with pytest.raises(ValueError) as e:
        kv_cache_budget(16 * GiB, 15 * GiB, 0.9)
    msg = str(e.value)
    assert "--gpu-memory-utilization 0.90" in msg and "no room for the KV cache" in msg and "\n" not in msg


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


def test_capabilities_cover_every_kernel_head_size():
    import torch

    from paged.backends.cuda.attention import SUPPORTED_HEAD_SIZES
    from paged.platforms.cuda import CudaPlatform

    class NoGpuToAsk(CudaPlatform):  # the dtype list a GPU of sm_80+ reports
        def supported_dtypes(self):
            return [torch.bfloat16, torch.float16, torch.float32]

    caps = NoGpuToAsk().capabilities()
    assert all(caps.accepts_head_size(d) for d in SUPPORTED_HEAD_SIZES)
    assert not any(caps.accepts_head_size(d) for d in (16, 48, 144, 192))  # no kernel instantiated
    for dtype in (torch.bfloat16, torch.float32):
        assert caps.invariant(dtype, "decode") and caps.invariant(dtype, "prefill")
        assert not caps.invariant(dtype, "engine")
