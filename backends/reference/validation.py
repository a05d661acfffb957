"""Argument checks for the kernel contract, written in plain torch.

The reference backend runs these once per call so that it rejects exactly
the inputs a compiled backend rejects (the conformance suite checks both the
same way). Messages come from core/argcheck.py:
``name: expected X, got Y``, naming the argument and the offending value.
"""

from __future__ import annotations

import torch

from paged.core.argcheck import fail, fail_index, fail_type

INDEX_DTYPES = {"slot_mapping": torch.int64, "block_tables": torch.int32,
                "seq_lens": torch.int32, "query_start_loc": torch.int32,
                "block_mapping": torch.int64}


def same_device(a: torch.device, b: torch.device) -> bool:
    """"cuda" matches "cuda:0": an unindexed device stands for the current one."""
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def check_tensor(name: str, t, ndim: int | None = None, dtype=None, device=None, shape=None):
    if not isinstance(t, torch.Tensor):
        fail_type(name, "a torch.Tensor", type(t).__name__)
    if ndim is not None and t.dim() != ndim:
        fail(name, f"a {ndim}-D tensor", f"shape {tuple(t.shape)}")
    if dtype is not None and t.dtype != dtype:
        fail(name, f"dtype {dtype}", t.dtype)
    if device is not None and not same_device(t.device, torch.device(device)):
        fail(name, f"a tensor on {device}", t.device)
    if shape is not None:
        for i, want in enumerate(shape):
            if want is not None and t.shape[i] != want:
                fail(name, f"dim {i} = {want}", f"shape {tuple(t.shape)}")
    if not t.is_contiguous():
        fail(name, "a contiguous tensor", f"shape {tuple(t.shape)} with stride {t.stride()}")


def check_index(name: str, t, ndim: int, device, length: int | None = None):
    check_tensor(name, t, ndim=ndim, dtype=INDEX_DTYPES[name], device=device)
    if length is not None and t.shape[0] != length:
        fail(name, f"{length} rows (one per token)", t.shape[0])


def check_caches(be, key_cache, value_cache):
    shape = be.kv_cache_shape(key_cache.shape[0] if isinstance(key_cache, torch.Tensor) and key_cache.dim() else 0)
    dtype = be.kv_cache_dtype
    check_tensor("key_cache", key_cache, ndim=len(shape), dtype=dtype, device=be.device, shape=shape)
    check_tensor("value_cache", value_cache, ndim=len(shape), dtype=dtype, device=be.device,
                 shape=tuple(key_cache.shape))


def check_heads(be, name: str, t, num_heads: int, rows: int | None = None):
    check_tensor(name, t, ndim=3, dtype=be.dtype, device=be.device, shape=(rows, num_heads, be.head_size))


def check_block_tables(be, block_tables, seq_lens, num_blocks: int):
    """Every sequence's used table entries (ceil(seq_len / block_size)) must be
    valid block ids; entries past the used ones are padding and ignored."""
    num_seqs = seq_lens.shape[0]
    if block_tables.shape[0] != num_seqs:
        fail("block_tables", f"one row per sequence ({num_seqs} in seq_lens)", f"{block_tables.shape[0]} rows")
    lens = seq_lens.cpu()
    if num_seqs and int(lens.min()) < 1:
        i = int(torch.argmin(lens))
        fail(f"seq_lens[{i}]", ">= 1", int(lens[i]))
    capacity = block_tables.shape[1] * be.block_size
    if num_seqs and int(lens.max()) > capacity:
        i = int(torch.argmax(lens))
        fail(f"seq_lens[{i}]", f"<= the block table capacity ({block_tables.shape[1]} blocks x "
             f"{be.block_size} = {capacity} tokens)", int(lens[i]))
    used = (lens + be.block_size - 1) // be.block_size
    cols = torch.arange(block_tables.shape[1])
    mask = cols[None, :] < used[:, None]
    tables = block_tables.cpu()
    bad = mask & ((tables < 0) | (tables >= num_blocks))
    if bool(bad.any()):
        s, j = (int(x) for x in bad.nonzero()[0])
        fail_index(f"block_tables[{s}, {j}]", f"a block id in [0, {num_blocks})", int(tables[s, j]))


def check_slots(name: str, slots, num_slots: int):
    s = slots.cpu()
    bad = s >= num_slots
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        fail_index(f"{name}[{i}]", f"a slot < {num_slots} (the cache's size) or < 0 (padding)", int(s[i]))


def check_query_start_loc(query_start_loc, num_tokens: int, seq_lens):
    q = query_start_loc.cpu().long()
    if q.shape[0] != seq_lens.shape[0] + 1:
        fail("query_start_loc", f"num_seqs + 1 = {seq_lens.shape[0] + 1} entries", q.shape[0])
    if int(q[0]) != 0 or int(q[-1]) != num_tokens:
        fail("query_start_loc", f"0..{num_tokens} (num_tokens)", f"{int(q[0])}..{int(q[-1])}")
    qlens = q[1:] - q[:-1]
    lens = seq_lens.cpu().long()
    bad = (qlens < 1) | (qlens > lens)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        fail(f"query tokens of sequence {i}", f"in [1, seq_lens[{i}] = {int(lens[i])}]", int(qlens[i]))


def check_block_mapping(block_mapping, num_src: int, num_dst: int, device=None):
    check_tensor("block_mapping", block_mapping, ndim=2, dtype=torch.int64, shape=(None, 2))
    m = block_mapping.cpu()
    for col, (what, n) in enumerate((("source", num_src), ("destination", num_dst))):
        bad = (m[:, col] < 0) | (m[:, col] >= n)
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            fail_index(f"block_mapping[{i}, {col}]", f"a {what} block id in [0, {n})", int(m[i, col]))


def check_scale_window(scale, sliding_window):
    if not isinstance(scale, (int, float)) or not (float(scale) == float(scale)) or float(scale) == 0.0:
        fail("scale", "a finite non-zero number", repr(scale))
    if sliding_window is not None and int(sliding_window) < 0:
        fail("sliding_window", ">= 0 (0 = unlimited)", sliding_window)
