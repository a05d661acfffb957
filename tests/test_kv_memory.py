"""The CPU KV cache commits memory as it is used (backends/cpu/host/kv_memory.py,
csrc_cpu/runtime/kv_arena.cpp): the block pool hands never-used blocks out
lowest id first, the arena reserves every block but commits only what is
written or pre-faulted, committing never changes a byte, the pre-faulter
runs ahead of the highest block written, and an engine's committed memory
starts small and grows with the blocks its requests write.
Residency is the kernel's (mincore); no timing is asserted
(benchmarks/kv_commit.py measures it)."""

import os
import random
import sys
import time

import pytest
import torch

from paged.core.engine.block_pool_spec import BlockPoolModel

C_blocks = pytest.importorskip("paged._C_blocks")
C_cpu = pytest.importorskip("paged._C_cpu")

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore residency as Linux reports it")
MiB = 1 << 20


@pytest.mark.parametrize("pool_cls", [C_blocks.BlockPool, BlockPoolModel], ids=["cpp", "model"])
@pytest.mark.parametrize("seed", range(4))
def test_pool_hands_out_unused_blocks_lowest_first(pool_cls, seed):
    """Whatever mix of allocations, frees, prefix registrations and hits: the
    blocks ever handed out are always 0..k-1, so the memory the KV cache
    touches grows from its start and the highest block written bounds it."""
    rng = random.Random(seed)
    pool, held, seen, next_hash = pool_cls(64), [], set(), 1
    for _ in range(400):
        op = rng.random()
        if op < 0.45:
            got = pool.allocate(rng.randint(1, 6))
        elif op < 0.55 and pool.cached_blocks():
            got = pool.lookup_prefix([rng.choice(list(pool.cached_blocks().values()))])
        else:
            got = None
            if held:
                rng.shuffle(held)
                cut = rng.randint(1, len(held))
                for b in held[:cut]:
                    if rng.random() < 0.5 and pool.block_hash(b) is None:
                        pool.register_hash(b, next_hash)  # a full block: reusable as a prefix
                        next_hash += 1
                pool.free(held[:cut])
                held = held[cut:]
        if got:
            held += got
            seen.update(got)
            assert seen == set(range(len(seen))), sorted(seen)


def resident(t: torch.Tensor) -> int:
    """Bytes of t's pages resident now (mincore)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    start = t.data_ptr() // page * page
    n = (t.data_ptr() + t.numel() * t.element_size() - start + page - 1) // page
    vec = (ctypes.c_ubyte * n)()
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(n * page), vec) == 0, ctypes.get_errno()
    return sum(b & 1 for b in vec) * page


@linux_only
def test_arena_commits_what_is_written_and_committed():
    """4 stripes of 64 blocks of 256 KiB: nothing resident at first;
    commit(k) makes the first k blocks of every stripe resident and no more
    than the huge pages holding them; a write past them commits its own
    pages; committing over written data keeps it."""
    block = 256 << 10
    arena = C_cpu.KvArena(4, 64, block)
    stripes = [torch.from_dlpack(arena.stripe(i)) for i in range(4)]
    assert arena.reserved_bytes == 4 * 64 * block and arena.committed_blocks == 0
    assert arena.resident_bytes() == 0 and all(resident(s) == 0 for s in stripes)
    stripes[2][5 * block + 17] = 42  # block 5 of stripe 2, before any commit
    arena.commit(16)
    assert arena.committed_blocks == 16
    for s in stripes:
        assert 16 * block <= resident(s) <= 16 * block + 2 * MiB, resident(s)  # a huge page at most rounds it up
    assert stripes[2][5 * block + 17] == 42 and int(stripes[2].sum()) == 42 and int(stripes[0].sum()) == 0
    before = arena.resident_bytes()
    assert before == sum(resident(s) for s in stripes) < arena.reserved_bytes
    stripes[3][50 * block] = 1  # a step writing past the committed blocks: its page only
    after = arena.resident_bytes()
    assert before < after <= before + 2 * MiB
    arena.commit(64)
    assert arena.resident_bytes() == arena.reserved_bytes and stripes[3][50 * block] == 1
    del arena  # the stripes keep the mapping
    stripes[0][-1] = 3
    assert int(stripes[0].sum()) == 3


def test_arena_rejects_bad_arguments():
    with pytest.raises(ValueError, match="stripes"):
        C_cpu.KvArena(0, 4, 4096)
    with pytest.raises(ValueError, match="block_bytes"):
        C_cpu.KvArena(1, 4, 0)
    with pytest.raises(ValueError, match="2\\^50"):
        C_cpu.KvArena(1 << 20, 1 << 20, 1 << 20)
    with pytest.raises(ValueError, match="cpus"):
        C_cpu.KvArena(1, 4, 4096, -1, [-1])
    arena = C_cpu.KvArena(2, 4, 4096)
    with pytest.raises(ValueError, match="end"):
        arena.commit(5)
    with pytest.raises(ValueError, match="end"):
        arena.prefault(-1)
    with pytest.raises(IndexError, match="stripe"):
        arena.stripe(2)
    assert C_cpu.KvArena(1, 4, 4096, 1000).numa_reason  # no such node: memory still comes, the reason says why


def wait_for(predicate, seconds: float = 60.0) -> bool:
    """Polls until predicate() holds (a liveness bound, not a timing)."""
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


@linux_only
def test_prefaulter_stays_ahead_of_the_highest_block_written():
    from paged.backends.cpu.host.kv_memory import AHEAD_MIN_STRIPE_BYTES, KvCacheMemory

    kv = KvCacheMemory(2, (4096, 2, 16, 64), torch.float16)  # 4 KiB blocks, 4 stripes of 16 MiB
    reserved, first = kv.reserved_bytes, AHEAD_MIN_STRIPE_BYTES // 4096  # the window: 4 MiB of a stripe
    assert kv.ahead == first and kv.arena.committed_blocks == first
    assert 4 * first * 4096 <= kv.committed_bytes() < reserved
    kv.written(3)
    assert kv.highest_written == 3 and kv.ahead == first
    kv.written(600)  # a burst of 597 new blocks: the window grows to twice that
    assert kv.ahead == 2 * 597
    assert wait_for(lambda: kv.arena.committed_blocks == 600 + 1 + 1194)
    assert 1795 * 4 * 4096 <= kv.committed_bytes() <= 4 * 8 << 20 < reserved  # 7 MiB of a stripe, in 2 MiB pages
    kv.written(3900)
    assert wait_for(lambda: kv.arena.committed_blocks == 4096)  # clamped to the pool
    assert kv.committed_bytes() == reserved
    kv.written(100)  # lower than before: nothing changes
    assert kv.highest_written == 3900


@linux_only
def test_on_demand_leaves_pages_to_first_write():
    from paged.backends.cpu.host.kv_memory import KvCacheMemory

    kv = KvCacheMemory(1, (1024, 1, 16, 64), torch.float32, prefault=False)  # 4 KiB blocks, 2 stripes of 4 MiB
    assert kv.committed_bytes() == 0
    kv.written(500)
    assert kv.arena.committed_blocks == 0 and kv.committed_bytes() == 0
    kv.caches[0][0][600, 0, 3, 5] = 1.0
    assert 0 < kv.committed_bytes() <= 2 * MiB
    full = KvCacheMemory(1, (1024, 1, 16, 64), torch.float32, commit_all=True)
    assert full.committed_bytes() == full.reserved_bytes


def one_cpu() -> str:
    return str(min(os.sched_getaffinity(0)))


@linux_only
def test_engine_commits_with_use(default_model_path):
    """The default model over a 1024-block cache (2.9 GiB reserved): a small
    window is committed at start and the pre-faulter's window follows the
    blocks the requests write, the cache far from fully committed. (Bytes
    move by huge pages of every stripe, 43 of these blocks: the arena tests
    above see them grow. The tokens on this memory are checked against HF
    and the reference backend by tests/test_engine*.py.)"""
    from paged.core.engine.config import EngineConfig
    from paged.core.engine.engine import Engine
    from paged.core.engine.sampling_params import SamplingParams

    engine = Engine(EngineConfig(model=str(default_model_path), device="cpu", num_kv_blocks=1024,
                                 max_model_len=1024, cpu_threads_bind=one_cpu()))
    kv = engine.attn_backend.kv_memory
    start_bytes, start_blocks = kv.committed_bytes(), kv.arena.committed_blocks
    assert 0 < start_bytes < kv.reserved_bytes / 4, (start_bytes, kv.reserved_bytes)
    before = kv.highest_written  # the warm-up's
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    for i in range(4):
        engine.add_request(str(i), [(7 * i + 13 * j) % 40000 + 100 for j in range(150)], params)
    while engine.has_unfinished_requests():
        engine.step()
    written = kv.highest_written
    assert written >= before + 4  # each request wrote blocks of its own, fresh ones
    assert wait_for(lambda: kv.arena.committed_blocks >= written + 1 + kv.ahead > start_blocks)
    assert start_bytes <= kv.committed_bytes() < kv.reserved_bytes / 2
