"""Shape, alignment and mask arithmetic for the Ascend backend.

Pure torch, no torch_npu: everything here runs (and is tested) on the CPU.
The constraints come from the torch_npu 2.13.0 operator docs
(npu_fused_infer_attention_score, npu_scatter_pa_kv_cache), see docs/ascend.md;
the simulator (tests/npu_sim) enforces the same ones.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from paged.core.argcheck import check_choice, fail
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)
# Paged attention with more than one query token (prefill, chunked prefill,
# prefix-cache hits) needs block_size a multiple of 128 in [128, 512].
BLOCK_SIZE_MULTIPLE = 128
MAX_BLOCK_SIZE = 512
HEAD_SIZE_ALIGN = 16          # D must be 16-aligned for fp16 / bf16
MAX_HEAD_SIZE = 512
MAX_GQA_RATIO = 64            # num_heads / num_kv_heads
MAX_KV_HIDDEN = 65535         # Hkv * D with the (blocks, block_size, Hkv*D) cache view
MAX_QUERY_HIDDEN = 65535      # N * D < this for a BSH query with Q_S > 1
MAX_HEADS = 256               # query heads, both branches
MAX_BATCH = 65536             # B, both branches
MAX_DECODE_KV_LEN = 262144    # Q_S = 1: the key/value S axis
INT32_MAX = 2**31 - 1         # Q_S = 1: elements of the key (and of the value) tensor
CAUSAL_MASK_SIZE = 2048       # sparse_mode 3 and 4 take a fixed 2048 x 2048 compressed mask


def check_shape(num_heads: int, num_kv_heads: int, head_size: int, block_size: int, dtype) -> None:
    """Raise ValueError naming the first value the CANN operators cannot take."""
    check_choice("dtype (npu)", dtype, SUPPORTED_DTYPES)
    if block_size <= 0 or block_size % BLOCK_SIZE_MULTIPLE or block_size > MAX_BLOCK_SIZE:
        fail("block_size (npu)", f"a multiple of {BLOCK_SIZE_MULTIPLE} in [{BLOCK_SIZE_MULTIPLE}, "
             f"{MAX_BLOCK_SIZE}] (the paged attention operator)", block_size)
    if head_size <= 0 or head_size % HEAD_SIZE_ALIGN or head_size > MAX_HEAD_SIZE:
        fail("head_size (npu)", f"a multiple of {HEAD_SIZE_ALIGN} up to {MAX_HEAD_SIZE}", head_size)
    if num_kv_heads <= 0 or num_heads % num_kv_heads or num_heads // num_kv_heads > MAX_GQA_RATIO:
        fail("num_heads / num_kv_heads (npu)", f"an integer ratio up to {MAX_GQA_RATIO}",
             f"{num_heads} / {num_kv_heads}")
    if num_kv_heads * head_size > MAX_KV_HIDDEN:
        fail("num_kv_heads * head_size (npu)", f"<= {MAX_KV_HIDDEN} (the (blocks, block_size, hidden) cache view)",
             num_kv_heads * head_size)
    if num_heads > MAX_HEADS:
        fail("num_heads (npu)", f"<= {MAX_HEADS}", num_heads)
    if num_heads * head_size >= MAX_QUERY_HIDDEN:
        fail("num_heads * head_size (npu)", f"< {MAX_QUERY_HIDDEN} (a BSH query with more than one token)",
             num_heads * head_size)


def max_decode_blocks(block_size: int, num_kv_heads: int, head_size: int) -> int:
    """The most blocks a layer's cache may have for the one-token (Q_S = 1)
    branch: its key tensor, [num_blocks, block_size, Hkv*D], must have at
    most INT32_MAX elements (the operator's documented limit)."""
    return INT32_MAX // (block_size * num_kv_heads * head_size)


def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
    """One layer's key (or value) cache: [num_blocks, block_size, Hkv, D], ND format.
    npu_scatter_pa_kv_cache writes it as is (its 'Norm' cache mode) and
    npu_fused_infer_attention_score reads it as [num_blocks, block_size, Hkv*D]."""
    return (num_blocks, block_size, num_kv_heads, head_size)


def padding_indices(q_lens: list[int]) -> dict[str, np.ndarray]:
    """The two gathers that turn varlen rows [T, H*D] into the BSH layout
    [B, max_q, H*D] (right-padded) and back, as host index arrays (the step
    sends them to the device with its other arrays, in one copy):
    ``pad_index`` [B*max_q] picks each padded row's query row (padding rows
    repeat their sequence's last row: the operator reads only the first
    actual_seq_lengths[b] rows); ``unpad_index`` [T] picks each real row of
    the flattened output. Two index_selects per layer instead of B copies."""
    q = np.asarray(q_lens, dtype=np.int64)
    max_q = int(q.max())
    starts = np.concatenate([[0], np.cumsum(q)[:-1]])
    r = np.arange(max_q)
    pad = (starts[:, None] + np.minimum(r[None, :], q[:, None] - 1)).reshape(-1)
    unpad = (np.arange(len(q))[:, None] * max_q + r[None, :])[r[None, :] < q[:, None]]
    return {"pad_index": pad.astype(np.int64), "unpad_index": unpad.astype(np.int64)}


def pad_queries(query: torch.Tensor, pad_index: torch.Tensor, batch: int) -> torch.Tensor:
    """[T, H, D] varlen rows -> [B, max_q, H*D] (BSH)."""
    t, h, d = query.shape
    return query.reshape(t, h * d).index_select(0, pad_index).view(batch, -1, h * d)


def unpad_output(padded: torch.Tensor, unpad_index: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[B, max_q, H*D] -> [T, H, D], the real rows only."""
    b, s, hd = padded.shape
    return padded.reshape(b * s, hd).index_select(0, unpad_index).view(-1, num_heads, hd // num_heads)


@functools.lru_cache(maxsize=None)
def causal_mask(device) -> torch.Tensor:
    """The compressed mask sparse_mode=3 (right-down causal) takes: True =
    masked. Made once per device (a 4 MiB bool tensor), never per step."""
    return torch.ones(CAUSAL_MASK_SIZE, CAUSAL_MASK_SIZE, dtype=torch.bool, device=device).triu_(1)


def decode_window_mask(seq_lens: torch.Tensor, kv_len: int, window: int) -> torch.Tensor:
    """[B, kv_len] mask (True = masked) for one-token steps with a sliding
    window, built on the device from the step's device ``seq_lens`` (no
    host copy): the query is the last position p = seq_len - 1 and sees keys
    j with p - window < j <= p. (With Q_S = 1 the operator takes no
    sparse_mode; this [B, KV_S] mask is its documented form, B x kv_len
    bytes.)"""
    lens = seq_lens.to(torch.int64)[:, None]
    j = torch.arange(kv_len, device=seq_lens.device)[None, :]
    return (j >= lens) | (j < lens - window)


def band_arguments(window: int) -> dict:
    """Sliding-window prefill without a dense mask: sparse_mode 4 (band)
    with the 2048 x 2048 compressed mask. The band is anchored at the
    bottom-right corner like sparse_mode 3 (the query rows are the
    sequence's last positions) and keeps keys j with
    p - pre_tokens <= j <= p + next_tokens, so a window of W keys (p - W <
    j <= p) is pre_tokens = W - 1, next_tokens = 0. (vllm-ascend passes
    pre_tokens = W; which one the operator means is the first thing the
    NPU conformance run's sliding-window checks decide.)"""
    return {"sparse_mode": 4, "pre_tokens": int(window) - 1, "next_tokens": 0}
