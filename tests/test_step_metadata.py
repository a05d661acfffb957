"""Per-step backend metadata (AttentionBackend.build_metadata, issue 16):
built once per step by the model runner, handed to every layer's forward.

The engine test runs real CPU steps through a subclass of the CPU backend
that counts; the NPU test checks what NpuBackend derives per step (host
lists, masks, write rows) against the step's tensors, on the CPU, no
operator involved.
"""

import os

import pytest
import torch

from paged.backends.base import AttentionMetadata
from paged.backends.cpu.attention import CpuBackend
from paged.backends.cpu.worker import CpuWorker
from paged.backends.npu.attention import NpuBackend, layout
from paged.backends.npu.metadata import NpuMetadata
from paged.core.engine.engine import Engine
from paged.core.engine.config import EngineConfig
from paged.core.engine.sampling_params import SamplingParams


class CountingCpuBackend(CpuBackend):
    """The real CPU backend, counting builds and the metadata each layer gets."""

    built: list = []
    seen: list = []

    def build_metadata(self, common):
        meta = super().build_metadata(common)
        CountingCpuBackend.built.append(meta)
        return meta

    def forward(self, query, key, value, kv_cache, meta):
        CountingCpuBackend.seen.append(meta)
        return super().forward(query, key, value, kv_cache, meta)


@pytest.fixture
def counting_engine(default_model_path, monkeypatch):
    monkeypatch.setattr(CpuWorker, "attention_backend_cls", lambda self: CountingCpuBackend)
    monkeypatch.setenv("PAGED_LAYER_STACK", "0")  # layer by layer, so every layer calls forward
    return Engine(EngineConfig(model=str(default_model_path), device="cpu", dtype="float32", max_model_len=256,
                               max_num_seqs=4, kv_cache_memory="64MiB", block_size=16,
                               cpu_threads_bind=str(min(os.sched_getaffinity(0)))))


def test_builder_runs_once_per_step_not_per_layer(counting_engine):
    engine = counting_engine
    assert isinstance(engine.attn_backend, CountingCpuBackend)
    CountingCpuBackend.built.clear()
    CountingCpuBackend.seen.clear()
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    engine.add_request("a", "The capital of France is", params)
    engine.add_request("b", "Once upon a time", params)
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    layers = engine.model_config.num_layers
    assert steps >= 3 and len(CountingCpuBackend.built) == steps
    assert len(CountingCpuBackend.seen) == steps * layers
    for i, meta in enumerate(CountingCpuBackend.built):  # each step's layers all got that step's object
        assert all(m is meta for m in CountingCpuBackend.seen[i * layers:(i + 1) * layers])


def _mixed_step(be, num_blocks=4):
    """Two decodes (lens 130, 5) then two prefills (3 of 7 tokens, 2 of 2),
    the last prefill row a padding slot."""
    tables = torch.tensor([[0, 1], [2, 0], [3, 0], [1, 0]], dtype=torch.int32)
    seq_lens = torch.tensor([130, 5, 7, 2], dtype=torch.int32)
    qsl = torch.tensor([0, 1, 2, 5, 7], dtype=torch.int32)
    slots = torch.tensor([129, 2 * 128 + 4, 3 * 128 + 4, 3 * 128 + 5, 3 * 128 + 6, 128, -1], dtype=torch.int64)
    return AttentionMetadata(slots, qsl, seq_lens, tables, num_decodes=2, max_query_len=3, max_seq_len=130)


@pytest.mark.parametrize("window", [0, 4])
def test_npu_metadata_holds_the_host_lists_and_masks(window):
    be = NpuBackend(4, 2, 16, 128, torch.float16, "cpu", sliding_window=window)
    be.allocate_kv_cache(1, 4)
    meta = be.build_metadata(_mixed_step(be))
    assert isinstance(meta, NpuMetadata)
    assert meta.decode_kv_lens == [130, 5]
    assert meta.prefill_q_lens == [3, 2] and meta.prefill_kv_lens == [7, 2]
    assert meta.write_rows.tolist() == [0, 1, 2, 3, 4, 5] and meta.write_slots.tolist() == [
        129, 260, 388, 389, 390, 128]
    if window:
        assert torch.equal(meta.decode_mask, layout.decode_window_mask(torch.tensor([130, 5]), 256, window))
        assert meta.prefill_extra["sparse_mode"] == 4 and meta.prefill_extra["pre_tokens"] == window - 1
        assert meta.prefill_extra["atten_mask"] is layout.causal_mask(torch.device("cpu"))  # the 2048 one, no dense mask
    else:
        assert meta.decode_mask is None and meta.prefill_extra["sparse_mode"] == 3
    # the common fields are the step's own tensors, not copies
    assert meta.block_tables.data_ptr() == be.build_metadata(meta).block_tables.data_ptr()


def test_npu_metadata_checks_block_ids_once_per_step():
    be = NpuBackend(4, 2, 16, 128, torch.float16, "cpu")
    be.allocate_kv_cache(1, 3)  # block 3 is now out of range
    with pytest.raises(IndexError, match="slot_mapping"):
        be.build_metadata(_mixed_step(be))
