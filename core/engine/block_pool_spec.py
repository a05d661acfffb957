"""Pure-Python model of the block pool rules (csrc_shared/block_allocator.h).

Same API and same observable behaviour as ``paged._C_cpu.BlockPool``: it is
the oracle of the stateful tests, the fallback the conformance suite and the
benchmark compare against, and a readable statement of the rules:

- ``allocate`` takes blocks from the head of the free queue; a block still
  holding a cached hash loses it there (eviction on reuse).
- ``free`` pushes the blocks whose ref count reaches 0, in reverse order of
  the call's list: never-hashed blocks to the head, hashed ones to the tail.
- every call validates all its arguments before changing anything.
"""

from __future__ import annotations

from collections import OrderedDict

_MASK = (1 << 64) - 1
_SEED = 0x70616765642D6B76
_TOKEN_TAG = 0x9E3779B97F4A7C15
_EXTRA_TAG = 0xD6E8FEB86659FD93


def _mix64(x: int) -> int:
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & _MASK
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def _hash_bytes(data: bytes) -> int:
    h = 0xCBF29CE484222325
    for c in data:
        h = ((h ^ c) * 0x100000001B3) & _MASK
    return h


def hash_block(parent: int, tokens, extra: str | None = None) -> int:
    """Same 64-bit block hash as the C++ ``hash_block`` (bit for bit)."""
    h = _mix64((parent ^ _SEED) & _MASK)
    for t in tokens:
        h = _mix64(h ^ _mix64((t + _TOKEN_TAG) & _MASK))
    h = _mix64(h ^ len(tokens))
    if extra is not None:
        h = _mix64(h ^ _mix64(_hash_bytes(extra.encode()) ^ _EXTRA_TAG))
    return h


class BlockPoolModel:
    """Python twin of the C++ BlockPool (see the module docstring)."""

    def __init__(self, num_blocks: int):
        if not 1 <= num_blocks <= 2**31 - 1:
            raise ValueError(f"num_blocks must be in [1, 2^31-1], got {num_blocks}")
        self._n = num_blocks
        self._ref = [0] * num_blocks
        self._hash: list[int | None] = [None] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[int, int] = {}
        self._queries = 0
        self._hits = 0

    @property
    def num_blocks(self) -> int:
        return self._n

    @property
    def num_free(self) -> int:
        return len(self._free)

    def _check_id(self, block: int, what: str) -> None:
        if not 0 <= block < self._n:
            raise IndexError(f"{what}: unknown block id {block} (pool has {self._n} blocks)")

    def _check_in_use(self, block: int, what: str) -> None:
        self._check_id(block, what)
        if self._ref[block] == 0:
            raise ValueError(f"{what}: block {block} is free")

    def _take_head(self) -> int:
        b, _ = self._free.popitem(last=False)
        h = self._hash[b]
        if h is not None:
            del self._cached[h]
            self._hash[b] = None
        self._ref[b] = 1
        return b

    def allocate(self, n: int) -> list[int] | None:
        if n < 0:
            raise ValueError(f"allocate: n must be >= 0, got {n}")
        if n > len(self._free):
            return None
        return [self._take_head() for _ in range(n)]

    def free(self, ids) -> None:
        ids = list(ids)
        for b in ids:
            self._check_id(b, "free")
        drops: dict[int, int] = {}
        for b in ids:
            drops[b] = drops.get(b, 0) + 1
            if drops[b] > self._ref[b]:
                kind = "has no reference left (ref count underflow)" if drops[b] > 1 else "is already free (double free)"
                raise ValueError(f"free: block {b} {kind}")
        released = []
        for b in ids:
            self._ref[b] -= 1
            if self._ref[b] == 0:
                released.append(b)
        for b in reversed(released):
            self._free[b] = None
            if self._hash[b] is None:
                self._free.move_to_end(b, last=False)

    def incref(self, ids) -> None:
        ids = list(ids)
        for b in ids:
            self._check_id(b, "incref")
        for b in ids:
            if self._ref[b] == 0:
                raise ValueError(f"incref: block {b} is free")
        for b in ids:
            self._ref[b] += 1

    def lookup_prefix(self, hashes) -> list[int]:
        hashes = list(hashes)
        out = []
        for h in hashes:
            b = self._cached.get(h)
            if b is None:
                break
            if self._ref[b] == 0:
                del self._free[b]
            self._ref[b] += 1
            out.append(b)
        self._queries += len(hashes)
        self._hits += len(out)
        return out

    def register_hash(self, block: int, hash: int) -> bool:
        self._check_in_use(block, "register_hash")
        if self._hash[block] is not None:
            if self._hash[block] == hash:
                return True
            raise ValueError(f"register_hash: block {block} already holds a different hash")
        if hash in self._cached:
            return False
        self._cached[hash] = block
        self._hash[block] = hash
        return True

    def cow(self, block: int) -> tuple[int, int] | None:
        self._check_in_use(block, "cow")
        if self._ref[block] == 1:
            return None
        if not self._free:
            raise RuntimeError(f"cow: no free block to copy shared block {block} into")
        dst = self._take_head()
        self._ref[block] -= 1
        return (block, dst)

    def mark_written(self, block: int) -> None:
        self._check_in_use(block, "mark_written")
        if self._ref[block] > 1:
            raise ValueError(f"write to shared block {block} (ref count {self._ref[block]}) without copy-on-write")

    def ref_count(self, block: int) -> int:
        self._check_id(block, "ref_count")
        return self._ref[block]

    def block_hash(self, block: int) -> int | None:
        self._check_id(block, "block_hash")
        return self._hash[block]

    def free_queue(self) -> list[int]:
        return list(self._free)

    def cached_blocks(self) -> dict[int, int]:
        return dict(self._cached)

    def stats(self) -> dict:
        used = self._n - len(self._free)
        return {
            "num_blocks": self._n,
            "used": used,
            "free": len(self._free),
            "cached": len(self._cached),
            "evictable": sum(self._hash[b] is not None for b in self._free),
            "usage": used / self._n,
            "prefix_queries": self._queries,
            "prefix_hits": self._hits,
            "hit_rate": self._hits / self._queries if self._queries else 0.0,
        }
