"""Shape, alignment and mask arithmetic for the Ascend backend.

Pure torch, no torch_npu: everything here runs (and is tested) on the CPU.
The constraints come from the torch_npu 2.13.0 operator docs
(npu_fused_infer_attention_score, npu_scatter_pa_kv_cache), see docs/ascend.md.
"""

from __future__ import annotations

import functools

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
CAUSAL_MASK_SIZE = 2048       # sparse_mode 3 takes a fixed 2048 x 2048 lower-triangular mask


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


def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
    """One layer's key (or value) cache: [num_blocks, block_size, Hkv, D], ND format.
    npu_scatter_pa_kv_cache writes it as is (its 'Norm' cache mode) and
    npu_fused_infer_attention_score reads it as [num_blocks, block_size, Hkv*D]."""
    return (num_blocks, block_size, num_kv_heads, head_size)


def padding_indices(q_lens: list[int], device) -> dict:
    """The two gathers that turn varlen rows [T, H*D] into the BSH layout
    [B, max_q, H*D] (right-padded) and back, as index tensors built once per
    step: ``pad_index`` [B*max_q] picks each padded row's query row (padding
    rows repeat their sequence's last row: the operator reads only the first
    actual_seq_lengths[b] rows); ``unpad_index`` [T] picks each real row of
    the flattened output. Two index_selects per layer instead of B copies."""
    max_q, pad, unpad, start = max(q_lens), [], [], 0
    for b, n in enumerate(q_lens):
        pad += [start + min(r, n - 1) for r in range(max_q)]
        unpad += range(b * max_q, b * max_q + n)
        start += n
    as_index = lambda rows: torch.tensor(rows, dtype=torch.int64, device=device)  # noqa: E731
    return {"pad_index": as_index(pad), "unpad_index": as_index(unpad)}


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


def window_mask(q_lens: list[int], seq_lens: list[int], kv_len: int, window: int, device) -> torch.Tensor:
    """Explicit mask [B, 1, max_q, kv_len] (True = masked) for sliding-window
    attention: query row r of sequence i sits at position
    p = seq_len - q_len + r and sees keys j with p - window < j <= p.
    Padding rows copy the last real row, so no row is fully masked."""
    max_q = max(q_lens)
    ql = torch.tensor(q_lens, device=device)[:, None]
    sl = torch.tensor(seq_lens, device=device)[:, None]
    r = torch.minimum(torch.arange(max_q, device=device)[None, :], ql - 1)
    pos = (sl - ql + r)[:, :, None]                       # [B, max_q, 1]
    j = torch.arange(kv_len, device=device)[None, None, :]
    visible = (j <= pos) & (j > pos - window) if window else (j <= pos)
    return (~visible)[:, None]


def decode_window_mask(seq_lens: list[int], kv_len: int, window: int, device) -> torch.Tensor:
    """[B, kv_len] mask (True = masked) for one-token decode with a sliding window."""
    return window_mask([1] * len(seq_lens), seq_lens, kv_len, window, device)[:, 0, 0]
