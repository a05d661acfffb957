"""EMULATION, not the kernel: the work split of csrc_cuda/prefill_tc.cu
(64-row CTA tiles of (position, head-of-group) rows, 4 warps x 16 rows, key
tiles of 64 / 32, the warp-uniform tile skips for causality and the sliding
window, the masks, the online softmax with P rounded to the dtype) replayed
in torch on the CPU from the kernel's source, against the reference
backend's attention. It checks that the split and the skips drop no visible
key and add no invisible one; it cannot check the CUDA code itself (that is
the GPU tests' job: tests/test_cuda_backend.py, skipped without a GPU).
Keep it in step with prefill_tc.cu."""

from __future__ import annotations

import math

import pytest
import torch

ROWS, WARP_ROWS = 64, 16


def first_visible_key(pos: int, window: int) -> int:
    return max(0, pos - window + 1) if window > 0 else 0


def emulate_prefill(q, k, v, seq_len, window, group, head_size, p_dtype):
    """q [q_len, group, D] (one kv head's query heads), k/v [seq_len, D]: the
    kernel's output for these rows, computed tile by tile as the kernel does."""
    q_len = q.shape[0]
    keys_per_tile = 32 if head_size > 128 else 64
    scale = 1.0 / math.sqrt(head_size)
    num_rows, pos0 = q_len * group, seq_len - q_len
    out = torch.zeros(num_rows, head_size)
    for row0 in range(0, num_rows, ROWS):  # one CTA
        last_row = min(row0 + ROWS, num_rows) - 1
        key_begin = first_visible_key(pos0 + row0 // group, window)
        key_end = pos0 + last_row // group + 1
        for w in range(4):
            first = row0 + w * WARP_ROWS
            rows = torch.arange(first, first + WARP_ROWS)
            ok = rows <= last_row
            pos = pos0 + rows // group
            warp_max_pos = pos0 + min(first + 15, last_row) // group
            warp_min_pos = pos0 + first // group
            m = torch.full((WARP_ROWS,), -math.inf)
            l = torch.zeros(WARP_ROWS)
            o = torch.zeros(WARP_ROWS, head_size)
            qw = torch.where(ok[:, None], q.reshape(num_rows, head_size)[rows.clamp(max=num_rows - 1)], 0.0)
            for tile in range(key_begin, key_end, keys_per_tile):
                if first > last_row or tile > warp_max_pos:
                    continue
                if window > 0 and tile + keys_per_tile - 1 <= warp_min_pos - window:
                    continue
                keys = torch.arange(tile, tile + keys_per_tile)
                kt = torch.zeros(keys_per_tile, head_size)
                vt = torch.zeros(keys_per_tile, head_size)
                inside = keys < key_end
                kt[inside], vt[inside] = k[keys[inside]], v[keys[inside]]
                s = (qw @ kt.T) * scale
                visible = ok[:, None] & (keys[None, :] < key_end) & (keys[None, :] <= pos[:, None])
                if window > 0:
                    visible &= keys[None, :] > pos[:, None] - window
                s = torch.where(visible, s, torch.tensor(-math.inf))
                m_new = torch.maximum(m, s.max(dim=1).values)
                live = m_new > -math.inf
                alpha = torch.where(live, torch.exp(m - m_new), torch.ones(()))
                p = torch.where(live[:, None], torch.exp(s - m_new[:, None]), torch.zeros(()))
                l = l * alpha + p.sum(dim=1)
                m = torch.where(live, m_new, m)
                o = o * alpha[:, None] + p.to(p_dtype).float() @ vt
            inv = torch.where(l > 0, 1.0 / l, torch.zeros(()))
            out[first:first + WARP_ROWS][: max(0, min(WARP_ROWS, num_rows - first))] = \
                (o * inv[:, None])[: max(0, min(WARP_ROWS, num_rows - first))]
    return out.view(q_len, group, head_size)


def reference(q, k, v, seq_len, window, head_size):
    q_len = q.shape[0]
    pos = torch.arange(seq_len - q_len, seq_len)
    keys = torch.arange(seq_len)
    mask = keys[None, :] <= pos[:, None]
    if window > 0:
        mask &= keys[None, :] > pos[:, None] - window
    s = torch.einsum("qgd,kd->qgk", q, k) / math.sqrt(head_size)
    s = s.masked_fill(~mask[:, None, :], -math.inf)
    return torch.einsum("qgk,kd->qgd", torch.softmax(s, dim=-1), v)


@pytest.fixture
def one_thread():
    # many tiny tensor ops: a thread pool only adds hand-offs (10x slower on a busy machine)
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("head_size", [80, 256])  # key tiles of 64 and of 32
@pytest.mark.parametrize("seq_len,q_len,group,window", [
    (5, 5, 4, 0),        # a fresh short prompt, rows in one warp
    (300, 33, 4, 0),     # a prefix hit: rows over 3 CTAs' warps, keys over several tiles
    (300, 200, 2, 0),    # many row tiles and key tiles, causal skips
    (300, 1, 8, 0),      # a one-token chunk
    (400, 150, 4, 100),  # sliding window: tiles before every row's window skipped
    (130, 130, 1, 40),   # MHA, window shorter than a key tile
    (149, 100, 1, 0),    # a warp's last position is a key tile's first key (the causal skip's edge)
    (260, 200, 1, 50),   # MHA + window: at head size 256 late warps skip a CTA's first key tile
])
def test_split_matches_reference(one_thread, head_size, seq_len, q_len, group, window):
    gen = torch.Generator().manual_seed(seq_len * 7 + q_len)
    q = torch.randn(q_len, group, head_size, generator=gen)
    k, v = torch.randn(seq_len, head_size, generator=gen), torch.randn(seq_len, head_size, generator=gen)
    want = reference(q, k, v, seq_len, window, head_size)
    exact = emulate_prefill(q, k, v, seq_len, window, group, head_size, torch.float32)
    torch.testing.assert_close(exact, want, atol=1e-5, rtol=1e-5)  # the split itself loses nothing
    rounded = emulate_prefill(q, k, v, seq_len, window, group, head_size, torch.bfloat16)
    torch.testing.assert_close(rounded, want, atol=3e-2, rtol=3e-2)  # PREFILL_TOL of the GPU test
