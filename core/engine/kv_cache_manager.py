"""KV cache manager: per-request block tables on top of the block pool.

API (docs/interfaces.md):

    mgr = KVCacheManager(num_blocks, block_size, enable_prefix_caching=True, pool_cls=None, hash_fn=None)
    mgr.get_computed_tokens(req_id, token_ids, extra_key=None) -> int
    mgr.allocate_slots(req_id, token_ids, num_computed_tokens, num_new_tokens) -> list[(src, dst)] | None
    mgr.block_table(req_id) -> list[int]
    mgr.truncate(req_id, num_tokens)   # speculative decoding: give back rejected slots
    mgr.free(req_id); mgr.fork(parent_id, child_id)
    mgr.num_free_blocks, mgr.num_blocks, mgr.block_size, mgr.can_allocate(num_tokens), mgr.stats()

The accounting (ref counts, LRU eviction, prefix hash map, copy-on-write)
lives in the pool: the engine passes ``shared_block_pool()``, the one C++
implementation every platform uses (paged._C_blocks); the default is its
pure-Python twin with the same rules (core/engine/block_pool_spec.py). This module only decides
which blocks a request holds and which full blocks get hashed. A block is
registered in the prefix cache as soon as a request's slots cover it fully:
its K/V is written by the next forward before any layer reads it, so a
request admitted in the same step may already reuse it.

Only verified tokens are ever hashed: ``token_ids`` passed to
``allocate_slots`` are the sequence's known tokens, while the slots may reach
further (speculative decoding writes draft tokens' K/V past them). A draft
slot lands in a block that is either beyond ``token_ids`` (never hashed) or
the one holding the last known token; the blocks it fills are hashed by a
later step, once ``token_ids`` has grown over them, after the true tokens'
K/V has overwritten what the rejected drafts wrote. ``truncate`` hands back
the blocks past a rollback point.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable


from paged.core.engine.block_pool_spec import BlockPoolModel, hash_block


def shared_block_pool():
    """(pool class, hash_block): the block accounting of every platform, since
    block ids never touch device memory (docs/architecture.md, "Block
    accounting"): the C++ pool of paged._C_blocks, or its pure-Python twin
    where the extension is not built."""
    try:
        from paged._C_blocks import BlockPool
        from paged._C_blocks import hash_block as cpp_hash_block
    except ImportError:
        return BlockPoolModel, hash_block
    return BlockPool, cpp_hash_block


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class _RequestBlocks:
    extra_key: str | None = None
    blocks: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)  # hash chain of the first full blocks
    num_registered: int = 0  # leading blocks already offered to the prefix cache


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, pool_cls=None,
                 hash_fn=None):
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._pool = (pool_cls or BlockPoolModel)(num_blocks)
        self._hash_block = hash_fn or hash_block
        self._reqs: dict[Hashable, _RequestBlocks] = {}

    # -- capacity --------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self._pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self._pool.num_free

    @property
    def pool(self):
        return self._pool

    def can_allocate(self, num_tokens: int) -> bool:
        return _ceil_div(num_tokens, self.block_size) <= self._pool.num_free

    # -- prefix caching ------------------------------------------------------------
    def _extend_hashes(self, req: _RequestBlocks, token_ids, num_full: int) -> None:
        bs = self.block_size
        parent = req.hashes[-1] if req.hashes else 0
        for i in range(len(req.hashes), num_full):
            parent = self._hash_block(parent, list(token_ids[i * bs:(i + 1) * bs]), req.extra_key)
            req.hashes.append(parent)

    def get_computed_tokens(self, req_id, token_ids, extra_key=None) -> int:
        """Admission: take the longest cached run of full prompt blocks (never
        the block holding the last prompt token's position when the prompt
        ends on a block boundary: that token is always recomputed). The hit
        blocks become the request's first blocks. Returns the cached tokens."""
        if req_id in self._reqs and self._reqs[req_id].blocks:
            raise ValueError(f"request {req_id!r} already holds KV blocks; free it before re-admitting")
        req = _RequestBlocks(extra_key=None if extra_key is None else str(extra_key))
        self._reqs[req_id] = req
        if not self.enable_prefix_caching or len(token_ids) <= 1:
            return 0
        self._extend_hashes(req, token_ids, (len(token_ids) - 1) // self.block_size)
        req.blocks = list(self._pool.lookup_prefix(req.hashes))
        req.num_registered = len(req.blocks)
        return len(req.blocks) * self.block_size

    # -- slots -----------------------------------------------------------------------
    def allocate_slots(self, req_id, token_ids, num_computed_tokens: int, num_new_tokens: int):
        """Room for positions [num_computed, num_computed + num_new). Returns the
        copy-on-write copies (src, dst) to perform before the forward, or None
        (nothing changed) when the pool lacks free blocks."""
        if num_computed_tokens < 0 or num_new_tokens < 0:
            raise ValueError(f"num_computed_tokens ({num_computed_tokens}) and num_new_tokens "
                             f"({num_new_tokens}) must be >= 0")
        req = self._reqs.setdefault(req_id, _RequestBlocks())
        bs = self.block_size
        if num_computed_tokens > len(req.blocks) * bs:
            raise ValueError(f"request {req_id!r}: num_computed_tokens {num_computed_tokens} exceeds its "
                             f"{len(req.blocks)} blocks of {bs} tokens")
        end = num_computed_tokens + num_new_tokens
        first_written = num_computed_tokens // bs
        last_needed = _ceil_div(end, bs)
        shared = [i for i in range(first_written, min(last_needed, len(req.blocks)))
                  if self._pool.ref_count(req.blocks[i]) > 1] if num_new_tokens else []
        num_new_blocks = max(0, last_needed - len(req.blocks))
        if num_new_blocks + len(shared) > self._pool.num_free:
            return None
        copies = []
        for i in shared:
            src, dst = self._pool.cow(req.blocks[i])
            req.blocks[i] = dst
            copies.append((src, dst))
            req.num_registered = min(req.num_registered, i)  # dst carries no hash yet
        if num_new_blocks:
            req.blocks.extend(self._pool.allocate(num_new_blocks))
        if self.enable_prefix_caching:
            self._register_full_blocks(req, token_ids, min(end, len(token_ids)) // bs)
        return copies

    def _register_full_blocks(self, req: _RequestBlocks, token_ids, num_full: int) -> None:
        if num_full <= req.num_registered:
            return
        self._extend_hashes(req, token_ids, num_full)
        for i in range(req.num_registered, num_full):
            self._pool.register_hash(req.blocks[i], req.hashes[i])
        req.num_registered = num_full

    def truncate(self, req_id, num_tokens: int) -> None:
        """Keep slots for positions [0, num_tokens) only: blocks past them go
        back to the pool (speculative decoding's rejected drafts). A block
        that stays registered holds verified tokens only, so a later prefix
        hit on it reads the right K/V."""
        req = self._reqs.get(req_id)
        if req is None:
            raise KeyError(f"unknown request {req_id!r}")
        if not 0 <= num_tokens <= len(req.blocks) * self.block_size:
            raise ValueError(f"num_tokens: expected 0 <= num_tokens <= {len(req.blocks) * self.block_size} "
                             f"(request {req_id!r} holds {len(req.blocks)} blocks), got {num_tokens}")
        keep = _ceil_div(num_tokens, self.block_size)
        if keep < len(req.blocks):
            dropped, req.blocks = req.blocks[keep:], req.blocks[:keep]
            self._pool.free(dropped)
        req.num_registered = min(req.num_registered, keep)
        del req.hashes[keep:]

    # -- tables, release, fork -------------------------------------------------------
    def block_table(self, req_id) -> list[int]:
        req = self._reqs.get(req_id)
        if req is None:
            raise KeyError(f"unknown request {req_id!r}")
        return list(req.blocks)

    def free(self, req_id) -> None:
        """Finish / abort / preempt: every block reference goes back (cached
        blocks stay reusable until evicted). Unknown ids are ignored."""
        req = self._reqs.pop(req_id, None)
        if req is not None and req.blocks:
            self._pool.free(req.blocks)

    def fork(self, parent_id, child_id) -> None:
        """The child shares every block of the parent, the partial last one
        included; the first write into a shared block is copied on write."""
        parent = self._reqs.get(parent_id)
        if parent is None:
            raise KeyError(f"unknown parent request {parent_id!r}")
        if child_id in self._reqs:
            raise ValueError(f"fork: request {child_id!r} already exists")
        self._pool.incref(parent.blocks)
        self._reqs[child_id] = _RequestBlocks(parent.extra_key, list(parent.blocks), list(parent.hashes),
                                              parent.num_registered)

    def stats(self) -> dict:
        s = self._pool.stats()
        keys = ("num_blocks", "used", "free", "cached", "usage", "prefix_queries", "prefix_hits", "hit_rate")
        return {k: s[k] for k in keys}
