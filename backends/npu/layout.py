"""Shape, alignment and mask arithmetic for the Ascend backend.

Pure torch, no torch_npu: everything here runs (and is tested) on the CPU.
The constraints come from the torch_npu 2.13.0 operator docs
(npu_fused_infer_attention_score, npu_scatter_pa_kv_cache), see docs/ascend.md.
"""

from __future__ import annotations

import torch

from paged.backends.arg_checks import check_choice, fail
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


def query_lens(query_start_loc: torch.Tensor) -> list[int]:
    q = query_start_loc.tolist()
    return [b - a for a, b in zip(q[:-1], q[1:])]


def pad_queries(query: torch.Tensor, q_lens: list[int]) -> torch.Tensor:
    """[T, H, D] varlen rows -> [B, max_q, H*D] right-padded (the BSH layout)."""
    t, h, d = query.shape
    b, max_q = len(q_lens), max(q_lens)
    out = query.new_zeros((b, max_q, h * d))
    start = 0
    for i, n in enumerate(q_lens):
        out[i, :n] = query[start:start + n].reshape(n, h * d)
        start += n
    return out


def unpad_output(padded: torch.Tensor, q_lens: list[int], num_heads: int) -> torch.Tensor:
    """Inverse of pad_queries: [B, max_q, H*D] -> [T, H, D]."""
    rows = [padded[i, :n] for i, n in enumerate(q_lens)]
    return torch.cat(rows).reshape(sum(q_lens), num_heads, -1)


def causal_mask(device) -> torch.Tensor:
    """The compressed mask sparse_mode=3 (right-down causal) takes: True = masked."""
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
