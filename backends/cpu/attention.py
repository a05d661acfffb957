"""CPU attention backend: the C++ kernels of paged._C_cpu (csrc_cpu/attention).

The kernels check every argument themselves (once per call) and raise
ValueError / IndexError naming the bad value; this wrapper only adapts the
Python API of AttentionBackend and allocates what the kernels write into.
"""

from __future__ import annotations

import torch
from torch.utils.dlpack import to_dlpack

from paged.core.argcheck import fail
from paged.backends.base import AttentionBackend, kv_row_width

__all__ = ["CpuBackend", "ops"]


def ops():
    """The compiled module (imported lazily so that importing paged.backends
    never requires the extension)."""
    from paged import _C_cpu

    return _C_cpu


def dl(t):
    """A tensor as a DLPack capsule for the extension: nanobind reading a
    torch tensor goes through its Python ``__dlpack__`` (~8 us a tensor, and
    these ops take 5-6 per layer); the capsule costs ~1 us. Anything else
    passes through for the extension's own argument checks to reject."""
    if isinstance(t, torch.Tensor):
        return to_dlpack(t.detach() if t.requires_grad else t)
    return t


class CpuBackend(AttentionBackend):
    name = "cpu"
    #: "float32": every prefill row through prefill_attention; "bf16" (set by
    #: the CPU worker for "mixed-bf16" models, backends/cpu/worker.py): the
    #: prompt rows (from meta.first_prompt_row) through prefill_attention_bf16,
    #: where the CPU has AMX-BF16 and the cache is a float one; "lanes" (set
    #: for "mixed" models): through prefill_attention_lanes, where the avx512
    #: attention build runs and the cache is a float one. The layer stack
    #: does the same (docs/kernels.md, "bfloat16 prompt attention",
    #: "Lane-major prompt attention").
    prompt_attention = "float32"
    #: how the KV cache commits its memory (backends/cpu/host/kv_memory.py):
    #: "prefault" (pages committed a little ahead of use by a background
    #: thread), "on-demand" (each page at its first write, inside a step) or
    #: "all" (everything before the engine starts); benchmarks/kv_commit.py
    #: compares them
    kv_commit = "prefault"
    #: the KV cache's memory once allocate_kv_cache has made it
    kv_memory = None
    #: every kernel takes the window and scale per call and build_metadata
    #: derives nothing from them, so layers of other windows share this
    #: backend (core/models/layer_attention.py: Gemma 3's local layers)
    per_layer_windows = True

    def __init__(self, *args, prompt_attention: str | None = None, **kwargs):
        """``prompt_attention``: the precision plan's prompt-row kernel
        (backends/cpu/precision.py), given as the backend is made."""
        super().__init__(*args, **kwargs)
        if prompt_attention is not None:
            if prompt_attention not in ("float32", "bf16", "lanes"):
                fail("prompt_attention", "'float32', 'bf16' or 'lanes'", repr(prompt_attention))
            self.prompt_attention = prompt_attention
        if self.device.type != "cpu":
            fail("device (CpuBackend)", "cpu", self.device)
        if self.head_size % 16 or not 16 <= self.head_size <= 256:
            fail("head_size (cpu kernels)", "a multiple of 16 in [16, 256]", self.head_size)
        self._ops = ops()

    # [num_blocks, num_kv_heads, block_size, row]: one head's tokens of a block
    # are contiguous, so a decode work item streams them linearly. row =
    # head_size, or head_size int8 + the row's float32 scale (kv_row_width).
    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (num_blocks, self.num_kv_heads, self.block_size, kv_row_width(self.head_size, self.kv_cache_dtype))

    def allocate_kv_cache(self, num_layers: int, num_blocks: int):
        """Every layer's (key, value) over one arena that reserves all the
        blocks and commits them as they come into use (kv_commit)."""
        from paged.backends.cpu.host.kv_memory import KvCacheMemory

        if self.kv_commit not in ("prefault", "on-demand", "all"):
            fail("kv_commit (CpuBackend)", "prefault, on-demand or all", self.kv_commit)
        self.kv_memory = KvCacheMemory(num_layers, self.kv_cache_shape(num_blocks), self.kv_cache_dtype,
                                       prefault=self.kv_commit == "prefault",
                                       commit_all=self.kv_commit == "all")
        return self.kv_memory.caches

    def build_metadata(self, common):
        """Nothing to derive; tells the KV memory the highest block this step
        writes, so its pre-faulter stays ahead of the block pool."""
        host = getattr(common, "host", None)
        if self.kv_memory is not None and host is not None and len(host.slot_mapping):
            self.kv_memory.written(int(host.slot_mapping.max()) // self.block_size)
        return common

    def reshape_and_cache(self, key, value, key_cache, value_cache, slot_mapping) -> None:
        self._ops.reshape_and_cache(dl(key), dl(value), dl(key_cache), dl(value_cache), dl(slot_mapping))

    def paged_attention(self, out, query, key_cache, value_cache, block_tables, seq_lens,
                        scale: float, sliding_window: int = 0) -> None:
        self._ops.paged_attention(dl(out), dl(query), dl(key_cache), dl(value_cache), dl(block_tables),
                                  dl(seq_lens), float(scale), int(sliding_window or 0))

    def prefill_attention(self, out, query, key_cache, value_cache, query_start_loc, seq_lens,
                          block_tables, scale: float, sliding_window: int = 0) -> None:
        self._ops.prefill_attention(dl(out), dl(query), dl(key_cache), dl(value_cache), dl(query_start_loc),
                                    dl(seq_lens), dl(block_tables), float(scale), int(sliding_window or 0))

    def prefill_attention_bf16(self, out, query, key_cache, value_cache, query_start_loc, seq_lens,
                               block_tables, scale: float, sliding_window: int = 0) -> None:
        self._ops.prefill_attention_bf16(dl(out), dl(query), dl(key_cache), dl(value_cache), dl(query_start_loc),
                                         dl(seq_lens), dl(block_tables), float(scale), int(sliding_window or 0))

    def prefill_attention_lanes(self, out, query, key_cache, value_cache, query_start_loc, seq_lens,
                                block_tables, scale: float, sliding_window: int = 0) -> None:
        self._ops.prefill_attention_lanes(dl(out), dl(query), dl(key_cache), dl(value_cache), dl(query_start_loc),
                                          dl(seq_lens), dl(block_tables), float(scale), int(sliding_window or 0))

    def prompt_attention_op(self, key_cache):
        """The op prompt rows over ``key_cache`` take (prompt_attention and
        the kernel's own test, as the layer stack asks), or None for
        prefill_attention."""
        if self.prompt_attention == "bf16" and self._ops.bf16_prompt_attention_reads(dl(key_cache)):
            return self.prefill_attention_bf16
        if self.prompt_attention == "lanes" and self._ops.lanes_prompt_attention_reads(dl(key_cache)):
            return self.prefill_attention_lanes
        return None

    def _forward_prefill(self, out, query, kv_cache, meta) -> None:
        first = meta.first_prompt_row
        op = None if first is None else self.prompt_attention_op(kv_cache[0])
        if op is None:
            return super()._forward_prefill(out, query, kv_cache, meta)
        qsl, lens, tables = meta.prefill_part
        starts = qsl.tolist()
        # prefill sequences before the first prompt row are verify rows: float32
        j = next((i for i, s in enumerate(starts[:-1]) if s >= first - meta.num_decodes), len(starts) - 1)
        split = starts[j]
        if j:
            self.prefill_attention(out[:split], query[:split], kv_cache[0], kv_cache[1], qsl[:j + 1], lens[:j],
                                   tables[:j], self.scale, self.sliding_window)
        if j < len(starts) - 1:
            op(out[split:], query[split:], kv_cache[0], kv_cache[1], qsl[j:] - split, lens[j:], tables[j:],
               self.scale, self.sliding_window)

    def copy_blocks(self, key_caches, value_caches, block_mapping) -> None:
        self._ops.copy_blocks(list(key_caches), list(value_caches), block_mapping)

    def swap_blocks(self, src_cache, dst_cache, block_mapping) -> None:
        self._ops.swap_blocks(src_cache, dst_cache, block_mapping)

    def read_kv(self, key_cache, value_cache, slot_mapping):
        if not isinstance(slot_mapping, torch.Tensor) or slot_mapping.dim() != 1:
            fail("slot_mapping", "a 1-D tensor", f"{slot_mapping!r:.80}")
        shape = (slot_mapping.shape[0], self.num_kv_heads, self.head_size)
        # in the model dtype, like the reference: a bfloat16 or int8 cache reads converted
        key = torch.empty(shape, dtype=self.dtype)
        value = torch.empty(shape, dtype=self.dtype)
        self._ops.read_kv(key_cache, value_cache, slot_mapping, key, value)
        return key, value
