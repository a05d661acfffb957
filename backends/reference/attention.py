"""The pure-torch reference backend: the oracle every platform is compared to.

It implements the kernel contract (docs/kernels.md) in the plainest way:
gather a sequence's blocks into contiguous K/V, then call
scaled_dot_product_attention with an explicit causal / sliding-window mask,
computing in float32 and casting back. No device-specific code, so it runs on
any device torch supports. The KV cache may hold another dtype than the model
(``kv_cache_dtype``): bfloat16, or int8 / float8_e4m3fn rows quantized as kv_quant.py says.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from paged.core.argcheck import fail
from paged.backends.base import AttentionBackend, kv_row_width
from paged.backends.reference import validation as v
from paged.backends.reference.kv_quant import from_cache, to_cache

__all__ = ["ReferenceBackend"]


class ReferenceBackend(AttentionBackend):
    name = "reference"

    # Layout [num_blocks, num_kv_heads, block_size, head_size]: one head's
    # tokens of a block are contiguous (the CPU backend uses the same).
    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (num_blocks, self.num_kv_heads, self.block_size, kv_row_width(self.head_size, self.kv_cache_dtype))

    # -- cache writes / reads ---------------------------------------------
    def reshape_and_cache(self, key, value, key_cache, value_cache, slot_mapping) -> None:
        v.check_caches(self, key_cache, value_cache)
        v.check_heads(self, "key", key, self.num_kv_heads)
        num_tokens = key.shape[0]
        v.check_heads(self, "value", value, self.num_kv_heads, rows=num_tokens)
        v.check_index("slot_mapping", slot_mapping, 1, self.device, length=num_tokens)
        v.check_slots("slot_mapping", slot_mapping, key_cache.shape[0] * self.block_size)
        keep = slot_mapping >= 0
        slots = slot_mapping[keep]
        blocks, offsets = slots // self.block_size, slots % self.block_size
        key_cache[blocks, :, offsets] = to_cache(key[keep], key_cache.dtype)
        value_cache[blocks, :, offsets] = to_cache(value[keep], value_cache.dtype)

    def read_kv(self, key_cache, value_cache, slot_mapping):
        v.check_caches(self, key_cache, value_cache)
        v.check_index("slot_mapping", slot_mapping, 1, self.device)
        v.check_slots("slot_mapping", slot_mapping, key_cache.shape[0] * self.block_size)
        keep = slot_mapping >= 0
        slots = slot_mapping.clamp(min=0)
        blocks, offsets = slots // self.block_size, slots % self.block_size
        def rows(cache):  # in the model dtype (exact for a float cache); padding reads as zeros
            x = from_cache(cache[blocks, :, offsets]).to(self.dtype)
            return torch.where(keep[:, None, None], x, torch.zeros((), dtype=x.dtype, device=x.device)).contiguous()

        return rows(key_cache), rows(value_cache)

    # -- attention ----------------------------------------------------------
    def _gather(self, cache, table_row, seq_len: int) -> torch.Tensor:
        """One sequence's first seq_len tokens as [num_heads, seq_len, D] float32
        (kv heads repeated for GQA)."""
        nb = (seq_len + self.block_size - 1) // self.block_size
        blocks = from_cache(cache[table_row[:nb].long()])  # [nb, Hkv, bs, D] float32
        x = blocks.permute(1, 0, 2, 3).reshape(self.num_kv_heads, nb * self.block_size, self.head_size)
        x = x[:, :seq_len]
        return x.repeat_interleave(self.num_heads // self.num_kv_heads, dim=0)

    def _attend(self, q, key_cache, value_cache, table_row, seq_len: int, scale: float, window: int):
        """q [n, H, D] holds the LAST n positions of the sequence; returns [n, H, D] float32."""
        n = q.shape[0]
        k = self._gather(key_cache, table_row, seq_len)
        val = self._gather(value_cache, table_row, seq_len)
        qpos = torch.arange(seq_len - n, seq_len, device=q.device)[:, None]
        kpos = torch.arange(seq_len, device=q.device)[None, :]
        mask = kpos <= qpos
        if window:
            mask &= kpos > qpos - window
        o = F.scaled_dot_product_attention(q.float().transpose(0, 1), k, val, attn_mask=mask, scale=scale)
        return o.transpose(0, 1)

    def _check_attention(self, out, query, key_cache, value_cache, block_tables, seq_lens, scale, window):
        v.check_caches(self, key_cache, value_cache)
        v.check_heads(self, "query", query, self.num_heads)
        v.check_heads(self, "out", out, self.num_heads, rows=query.shape[0])
        v.check_index("seq_lens", seq_lens, 1, self.device)
        v.check_index("block_tables", block_tables, 2, self.device)
        v.check_block_tables(self, block_tables, seq_lens, key_cache.shape[0])
        v.check_scale_window(scale, window)

    def _check_decode(self, out, query, key_cache, value_cache, block_tables, seq_lens, scale, window):
        """Decode arguments: the attention checks plus one sequence per query row."""
        self._check_attention(out, query, key_cache, value_cache, block_tables, seq_lens, scale, window)
        if seq_lens.shape[0] != query.shape[0]:
            fail("seq_lens", f"one entry per query row ({query.shape[0]})", f"{seq_lens.shape[0]} entries")

    def paged_attention(self, out, query, key_cache, value_cache, block_tables, seq_lens,
                        scale: float, sliding_window: int = 0) -> None:
        self._check_decode(out, query, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window)
        lens = seq_lens.tolist()
        for i, n in enumerate(lens):
            o = self._attend(query[i:i + 1], key_cache, value_cache, block_tables[i], n, scale,
                             int(sliding_window or 0))
            out[i] = o[0].to(out.dtype)

    def prefill_attention(self, out, query, key_cache, value_cache, query_start_loc, seq_lens,
                          block_tables, scale: float, sliding_window: int = 0) -> None:
        self._check_attention(out, query, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window)
        v.check_index("query_start_loc", query_start_loc, 1, self.device)
        v.check_query_start_loc(query_start_loc, query.shape[0], seq_lens)
        starts = query_start_loc.tolist()
        for i, n in enumerate(seq_lens.tolist()):
            a, b = starts[i], starts[i + 1]
            o = self._attend(query[a:b], key_cache, value_cache, block_tables[i], n, scale,
                             int(sliding_window or 0))
            out[a:b] = o.to(out.dtype)

    # -- block copies -----------------------------------------------------
    def copy_blocks(self, key_caches, value_caches, block_mapping) -> None:
        """For every layer, block dst <- block src; all copies read the state
        before the call, destinations must be distinct."""
        if len(key_caches) != len(value_caches):
            fail("value_caches", f"one per layer of key_caches ({len(key_caches)})", len(value_caches))
        if not len(key_caches):
            return
        for kc, vc in zip(key_caches, value_caches):
            v.check_caches(self, kc, vc)
            if kc.shape != key_caches[0].shape:
                fail("key_caches", f"one cache shape for all layers {tuple(key_caches[0].shape)}",
                     tuple(kc.shape))
        n = key_caches[0].shape[0]
        v.check_block_mapping(block_mapping, n, n)
        check_distinct_destinations(block_mapping)
        src, dst = block_mapping[:, 0].to(self.device), block_mapping[:, 1].to(self.device)
        for cache in (*key_caches, *value_caches):
            cache[dst] = cache[src]

    def swap_blocks(self, src_cache, dst_cache, block_mapping) -> None:
        """dst_cache[dst] <- src_cache[src]; the two may live on different devices."""
        v.check_tensor("src_cache", src_cache)
        v.check_tensor("dst_cache", dst_cache, ndim=src_cache.dim(), dtype=src_cache.dtype,
                       shape=(None, *src_cache.shape[1:]))
        v.check_block_mapping(block_mapping, src_cache.shape[0], dst_cache.shape[0])
        check_distinct_destinations(block_mapping)
        m = block_mapping.cpu()
        src = m[:, 0].to(src_cache.device)
        dst = m[:, 1].to(dst_cache.device)
        dst_cache[dst] = src_cache[src].to(dst_cache.device)


def check_distinct_destinations(block_mapping):
    dst = block_mapping[:, 1].cpu()
    uniq, counts = torch.unique(dst, return_counts=True)
    if bool((counts > 1).any()):
        fail("block_mapping", "distinct destination blocks", f"block {int(uniq[counts > 1][0])} written more than once")
