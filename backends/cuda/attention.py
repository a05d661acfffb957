"""CUDA attention backend on paged._C_cuda (csrc_cuda/, docs/cuda.md).

KV layout per layer: [num_blocks, num_kv_heads, block_size, head_size] for
keys and values alike (the reference backend's layout, so ``read_kv`` and the
argument checks are inherited from it). Head sizes of SUPPORTED_HEAD_SIZES;
float32, float16, bfloat16; any block size (16..128 are the tested ones).

Every op runs on the caller's current torch stream. Tensors cross into C++ as
DLPack capsules (``torch.utils.dlpack.to_dlpack``: no stream handshake, the op
itself is ordered on the current stream). The C++ boundary checks shapes,
dtypes, devices and contiguity. Block ids that live on the GPU (block tables,
slot mappings, query_start_loc) are guarded inside the kernels (stray ids are
skipped, never read or written out of bounds) and, by default, also checked
on the host, raising IndexError / ValueError naming the value: in the model
runner's steps once per step, where ``build_metadata`` builds the metadata
(on the runner's host arrays: no device->host copy; the layers then launch
unchecked); in direct calls to the contract ops once per distinct input
(id_checks.py). The decode launch is sized by the step's longest decode
sequence (launch.py).
``CudaBackend(check_ids=False)`` or ``PAGED_CUDA_CHECK_IDS=0`` turns those
host copies off (the kernels' guards remain). Host-side block mappings are
always checked.
"""

from __future__ import annotations

import os

import torch
from torch.utils.dlpack import to_dlpack

from paged.core.argcheck import check_choice, check_range, fail
from paged.backends.base import AttentionMetadata
from paged.backends.reference.attention import ReferenceBackend, check_distinct_destinations
from paged.backends.reference import validation as v
from paged.backends.cuda import launch
from paged.backends.cuda.id_checks import CheckedOnce
from paged.backends.cuda.metadata import CudaMetadata, build_step, layer_launch, split_workspace
from paged.core.engine.model_runner import to_device

__all__ = ["CudaBackend", "SUPPORTED_HEAD_SIZES", "SUPPORTED_DTYPES"]

SUPPORTED_HEAD_SIZES = (64, 80, 96, 112, 128, 256)  # csrc_cuda/ops.h kHeadSizes (a test compares)
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _ops():
    from paged import _C_cuda  # imported on first use: the backend module itself loads anywhere

    return _C_cuda


def _stream(device: torch.device) -> int:
    return torch.cuda.current_stream(device).cuda_stream


class CudaBackend(ReferenceBackend):
    name = "cuda"
    #: each layer attends with its own window (core/models/layer_attention.py): the kernels take it per
    #: call, and a narrower layer launches what its window needs (metadata.layer_launch)
    per_layer_windows = True

    def __init__(self, num_heads, num_kv_heads, head_size, block_size, dtype, device="cuda",
                 scale=None, sliding_window=None, check_ids: bool | None = None, kv_cache_dtype=None):
        check_choice("head_size (cuda)", head_size, SUPPORTED_HEAD_SIZES)
        check_choice("dtype (cuda)", dtype, SUPPORTED_DTYPES)
        check_range("block_size", int(block_size), lo=1)
        if kv_cache_dtype not in (None, dtype):  # the kernels read the cache in the model dtype
            fail("kv_cache_dtype (cuda)", f"the model dtype {dtype}", kv_cache_dtype)
        super().__init__(num_heads, num_kv_heads, head_size, block_size, dtype, device, scale, sliding_window,
                         kv_cache_dtype)
        if self.device.type != "cuda":
            fail("device (cuda backend)", "a cuda device", self.device)
        if self.device.index is None:  # pin "cuda" to a concrete device so checks compare equal
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.check_ids = (os.environ.get("PAGED_CUDA_CHECK_IDS", "1") != "0") if check_ids is None else bool(check_ids)
        self._checked = CheckedOnce()
        self.num_blocks: int | None = None  # known once allocate_kv_cache ran: the step checks need it

    # -- cache allocation --------------------------------------------------
    def allocate_kv_cache(self, num_layers: int, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """All layers' K and V caches carved from one cudaMalloc (a DeviceArena);
        the tensors keep the arena alive."""
        shape = self.kv_cache_shape(num_blocks)
        elem = torch.empty((), dtype=self.dtype).element_size()
        tensor_bytes = -(-(num_blocks * self.num_kv_heads * self.block_size * self.head_size * elem) // 256) * 256
        self.num_blocks = int(num_blocks)
        arena = _ops().DeviceArena(max(1, 2 * num_layers * tensor_bytes), self.device.index)
        dtype_name = str(self.dtype).removeprefix("torch.")
        views = [arena.view(i * tensor_bytes, list(shape), dtype_name).zero_() for i in range(2 * num_layers)]
        return [(views[2 * i], views[2 * i + 1]) for i in range(num_layers)]

    # -- the kernel contract -------------------------------------------------
    def _check_tables(self, block_tables, seq_lens, key_cache) -> None:
        if self.check_ids:
            self._checked.run("block_tables", (block_tables, seq_lens), (key_cache.shape[0],),
                              lambda: v.check_block_tables(self, block_tables, seq_lens, key_cache.shape[0]))

    def reshape_and_cache(self, key, value, key_cache, value_cache, slot_mapping) -> None:
        v.check_caches(self, key_cache, value_cache)
        if self.check_ids:
            num_slots = key_cache.shape[0] * self.block_size
            self._checked.run("slot_mapping", (slot_mapping,), (num_slots,),
                              lambda: v.check_slots("slot_mapping", slot_mapping, num_slots))
        self._write(key, value, key_cache, value_cache, slot_mapping)

    def _write(self, key, value, key_cache, value_cache, slot_mapping) -> None:
        _ops().reshape_and_cache(to_dlpack(key), to_dlpack(value), to_dlpack(key_cache), to_dlpack(value_cache),
                                 to_dlpack(slot_mapping), _stream(key_cache.device))

    def paged_attention(self, out, query, key_cache, value_cache, block_tables, seq_lens,
                        scale: float, sliding_window: int = 0) -> None:
        # Called directly, the longest length is not known on the host: the
        # table's width bounds it (forward() uses the step's own, from the host).
        window = int(sliding_window or 0)
        width = block_tables.shape[1] if isinstance(block_tables, torch.Tensor) and block_tables.dim() == 2 else 0
        splits = launch.decode_splits(width * self.block_size, window)
        num_seqs = seq_lens.shape[0] if isinstance(seq_lens, torch.Tensor) and seq_lens.dim() else 0
        num_heads = query.shape[1] if isinstance(query, torch.Tensor) and query.dim() == 3 else 0
        v.check_caches(self, key_cache, value_cache)
        self._check_tables(block_tables, seq_lens, key_cache)
        workspace = split_workspace(num_seqs, num_heads, splits, self.head_size, self.device)
        self._decode(out, query, key_cache, value_cache, block_tables, seq_lens, scale, window, splits, workspace)

    def _decode(self, out, query, key_cache, value_cache, block_tables, seq_lens, scale, window, splits, workspace):
        split_out, split_max_sum = workspace
        _ops().paged_attention(to_dlpack(out), to_dlpack(query), to_dlpack(key_cache), to_dlpack(value_cache),
                               to_dlpack(block_tables), to_dlpack(seq_lens), float(scale), window,
                               to_dlpack(split_out), to_dlpack(split_max_sum), int(splits),
                               _stream(key_cache.device))

    def prefill_attention(self, out, query, key_cache, value_cache, query_start_loc, seq_lens,
                          block_tables, scale: float, sliding_window: int = 0) -> None:
        # Called directly, the step's longest query is unknown: launch a tile
        # for every row (extra CTAs exit at once); forward() passes the real one.
        v.check_caches(self, key_cache, value_cache)
        self._check_tables(block_tables, seq_lens, key_cache)
        if self.check_ids:
            self._checked.run("query_start_loc", (query_start_loc, seq_lens), (query.shape[0],),
                              lambda: v.check_query_start_loc(query_start_loc, query.shape[0], seq_lens))
        rows = int(query.shape[0]) if isinstance(query, torch.Tensor) and query.dim() else 0
        self._prefill(out, query, key_cache, value_cache, query_start_loc, seq_lens, block_tables,
                      scale, sliding_window, rows)

    def _prefill(self, out, query, key_cache, value_cache, query_start_loc, seq_lens, block_tables,
                 scale, sliding_window, max_query_len: int) -> None:
        rows = int(query.shape[0]) if query.dim() else 0
        if rows == 0:
            return
        _ops().prefill_attention(to_dlpack(out), to_dlpack(query), to_dlpack(key_cache), to_dlpack(value_cache),
                                 to_dlpack(query_start_loc), to_dlpack(seq_lens), to_dlpack(block_tables),
                                 min(max_query_len, rows), float(scale), int(sliding_window or 0),
                                 _stream(key_cache.device))

    # -- once per step, then every layer ---------------------------------------
    def build_metadata(self, common: AttentionMetadata) -> CudaMetadata:
        """Checks the step's block ids once (on the runner's host arrays;
        skipped with check_ids off or before the cache exists), then derives
        the launch sizes and the split-K workspace every layer shares."""
        return self._step(common, self.num_blocks)

    def _step(self, common: AttentionMetadata, num_blocks: int | None) -> CudaMetadata:
        return build_step(common, block_size=self.block_size, num_heads=self.num_heads, head_size=self.head_size,
                          sliding_window=self.sliding_window, device=self.device, num_blocks=num_blocks,
                          check_ids=self.check_ids)

    def split_workspace(self, num_decodes: int, splits: int):
        """(split_out, split_max_sum) for that many decodes (empty when splits == 1)."""
        return split_workspace(num_decodes, self.num_heads, splits, self.head_size, self.device)

    def forward(self, query, key, value, kv_cache, meta):
        if not isinstance(meta, CudaMetadata):  # a caller outside the model runner (tests)
            meta = self._step(meta, kv_cache[0].shape[0])  # this cache's size, whatever allocated it
        return super().forward(query, key, value, kv_cache, meta)

    def _forward_write(self, key, value, kv_cache, meta) -> None:
        self._write(key, value, kv_cache[0], kv_cache[1], meta.slot_mapping)

    def _forward_decode(self, out, query, kv_cache, meta, block_tables, seq_lens) -> None:
        splits, workspace = layer_launch(meta, self.sliding_window)
        self._decode(out, query, kv_cache[0], kv_cache[1], block_tables, seq_lens, self.scale,
                     self.sliding_window, splits, workspace)

    def _forward_prefill(self, out, query, kv_cache, meta) -> None:
        qsl, lens, tables = meta.prefill_part
        self._prefill(out, query, kv_cache[0], kv_cache[1], qsl, lens, tables, self.scale,
                      self.sliding_window, meta.prefill_max_query_len)

    def copy_blocks(self, key_caches, value_caches, block_mapping) -> None:
        """All copies read the state before the call. The kernel copies pairs
        in parallel, so a mapping whose destinations include a source (never
        the case for copy-on-write, where destinations are fresh blocks) is
        done with torch indexing instead when the mapping is on the host.
        The model runner passes it on the host: checked there, then moved
        as the step's inputs are (model_runner.to_device: from page-locked
        memory, non-blocking; from pageable memory the runtime would wait
        for the stream)."""
        if not len(key_caches) and not len(value_caches):
            return
        host = block_mapping if block_mapping.device.type == "cpu" else (
            block_mapping.cpu() if self.check_ids else None)
        if host is not None:
            n = key_caches[0].shape[0] if len(key_caches) else 0
            v.check_block_mapping(host, n, n)
            check_distinct_destinations(host)
            if bool(torch.isin(host[:, 1], host[:, 0]).any()):
                super().copy_blocks(key_caches, value_caches, block_mapping)
                return
        if block_mapping.shape[0] == 0:
            return
        mapping = (to_device({"block_mapping": block_mapping.numpy()}, key_caches[0].device)["block_mapping"]
                   if block_mapping.device.type == "cpu" else block_mapping)  # pinned, non-blocking
        _ops().copy_blocks([to_dlpack(c) for c in key_caches], [to_dlpack(c) for c in value_caches],
                           to_dlpack(mapping), _stream(key_caches[0].device))

    def swap_blocks(self, src_cache, dst_cache, block_mapping) -> None:
        v.check_tensor("block_mapping", block_mapping, ndim=2, dtype=torch.int64, shape=(None, 2))
        mapping = block_mapping.cpu()
        check_distinct_destinations(mapping)
        device = src_cache.device if src_cache.device.type == "cuda" else dst_cache.device
        if device.type != "cuda":
            fail("swap_blocks devices", "a CUDA cache on one side", f"{src_cache.device} -> {dst_cache.device}")
        _ops().swap_blocks(to_dlpack(src_cache), to_dlpack(dst_cache), to_dlpack(mapping), _stream(device))
