"""Block pool: C++ BlockPool vs the pure-Python model, misuse errors, hashing,
threads, and NUMA host memory."""

import sys
import threading

import pytest
import torch
from hypothesis import given, settings, strategies as st

from paged.core.engine.block_pool_spec import BlockPoolModel, hash_block as py_hash_block

C = pytest.importorskip("paged._C_blocks")

POOLS = [C.BlockPool, BlockPoolModel]


@pytest.fixture(params=POOLS, ids=["cpp", "model"])
def pool_cls(request):
    return request.param


@settings(max_examples=200, deadline=None)
@given(parent=st.integers(0, 2**64 - 1),
       tokens=st.lists(st.integers(-2**63, 2**63 - 1), max_size=20),
       extra=st.none() | st.text(max_size=8))
def test_hash_matches_python_model(parent, tokens, extra):
    assert C.hash_block(parent, tokens, extra) == py_hash_block(parent, tokens, extra)


def test_hash_separates_parent_tokens_and_extra():
    h = C.hash_block(0, [1, 2, 3])
    assert h == C.hash_block(0, [1, 2, 3])
    assert len({h, C.hash_block(1, [1, 2, 3]), C.hash_block(0, [1, 2, 3, 0]),
                C.hash_block(0, [3, 2, 1]), C.hash_block(0, [1, 2, 3], ""),
                C.hash_block(0, [1, 2, 3], "salt")}) == 6


def test_lru_and_eviction_order(pool_cls):
    pool = pool_cls(6)
    a = pool.allocate(3)
    assert pool.register_hash(a[0], 10) and pool.register_hash(a[1], 11)
    pool.free(a)
    queue = pool.free_queue()
    # the never-hashed block is reused first; the request's later cached block is evicted before its first
    assert queue[0] == a[2] and queue[-2:] == [a[1], a[0]]
    assert pool.stats()["evictable"] == 2
    assert pool.lookup_prefix([10, 11, 12]) == [a[0], a[1]]  # touch: out of the free queue, ref 1
    assert pool.ref_count(a[0]) == 1 and a[0] not in pool.free_queue()
    pool.free([a[0], a[1]])
    got = pool.allocate(6)
    assert got[-2:] == [a[1], a[0]] and pool.cached_blocks() == {}
    assert pool.lookup_prefix([10]) == []


def test_allocate_refuses_without_changing_state(pool_cls):
    pool = pool_cls(4)
    pool.allocate(3)
    before = (pool.free_queue(), pool.stats())
    assert pool.allocate(2) is None
    assert (pool.free_queue(), pool.stats()) == before


def test_cow(pool_cls):
    pool = pool_cls(3)
    (b,) = pool.allocate(1)
    assert pool.cow(b) is None
    pool.incref([b])
    with pytest.raises(ValueError, match=f"shared block {b} "):
        pool.mark_written(b)
    src, dst = pool.cow(b)
    assert src == b and dst != b and pool.ref_count(b) == 1 and pool.ref_count(dst) == 1
    pool.mark_written(dst)
    rest = pool.allocate(1)
    pool.incref([b])
    with pytest.raises(RuntimeError, match=f"block {b} "):
        pool.cow(b)
    assert pool.ref_count(b) == 2 and pool.num_free == 0
    pool.free([b, b, dst] + rest)
    assert pool.num_free == 3


@pytest.mark.parametrize("bad", [-1, 4, 2**31 - 1])
def test_unknown_id_is_index_error_naming_it(pool_cls, bad):
    pool = pool_cls(4)
    for call in (lambda: pool.free([bad]), lambda: pool.incref([bad]), lambda: pool.cow(bad),
                 lambda: pool.mark_written(bad), lambda: pool.ref_count(bad),
                 lambda: pool.register_hash(bad, 1)):
        with pytest.raises(IndexError, match=f"block id {bad} "):
            call()


def test_misuse_is_value_error_naming_the_block(pool_cls):
    pool = pool_cls(4)
    a = pool.allocate(2)
    with pytest.raises(ValueError, match=r"block 3 is already free \(double free\)"):
        pool.free([3])
    with pytest.raises(ValueError, match=f"block {a[1]} .*underflow"):
        pool.free([a[0], a[1], a[1]])
    assert [pool.ref_count(b) for b in a] == [1, 1]  # the failed call changed nothing
    with pytest.raises(ValueError, match="block 3 is free"):
        pool.incref([a[0], 3])
    assert pool.ref_count(a[0]) == 1
    for call in (lambda: pool.cow(3), lambda: pool.mark_written(3), lambda: pool.register_hash(3, 5)):
        with pytest.raises(ValueError, match="block 3 is free"):
            call()
    assert pool.register_hash(a[0], 5)
    with pytest.raises(ValueError, match=f"block {a[0]} already holds a different hash"):
        pool.register_hash(a[0], 6)
    with pytest.raises(ValueError, match="-1"):
        pool.allocate(-1)
    with pytest.raises(ValueError, match="num_blocks"):
        pool_cls(0)
    with pytest.raises(TypeError):
        C.BlockPool("many")


def test_threads_share_one_pool():
    pool = C.BlockPool(128)
    stop = threading.Event()
    bad = []

    def reader():
        while not stop.is_set():
            s = pool.stats()
            if s["free"] + s["used"] != s["num_blocks"]:
                bad.append(s)

    def worker(seed):
        for i in range(1500):
            got = pool.lookup_prefix([seed * 7 + i % 5]) + (pool.allocate(1 + (i + seed) % 6) or [])
            if got:
                pool.register_hash(got[0], pool.block_hash(got[0]) or seed * 7 + i % 5)
                pool.free(got)

    threads = [threading.Thread(target=reader)] + [threading.Thread(target=worker, args=(s,)) for s in range(3)]
    for t in threads:
        t.start()
    for t in threads[1:]:
        t.join()
    stop.set()
    threads[0].join()
    assert not bad and pool.num_free == 128


def test_numa_zeros_uses_host_arena():
    from paged import _C_cpu
    from paged.backends.cpu.host.memory import last_allocation, numa_zeros

    t = numa_zeros((5, 16, 2, 8), torch.bfloat16)
    info = last_allocation()
    assert info["method"] == "host_arena", info
    assert t.shape == (5, 16, 2, 8) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert t.data_ptr() % 4096 == 0 and not t.any()
    t[3, 7] = 1.5  # writable, and the memory outlives views taken before the base is dropped
    view = t[3]
    del t
    assert view[7].eq(1.5).all() and view.sum().item() == 1.5 * 16
    node = _C_cpu.current_numa_node()
    if node >= 0:
        numa_zeros((4,), torch.float32, node=node)
        assert last_allocation()["numa_policy"] == "preferred", last_allocation()


def _resident_pages(t: torch.Tensor) -> tuple[int, int]:
    """(resident, total) 4 KiB-or-larger pages under t's storage, from mincore(2)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    n = (t.untyped_storage().nbytes() + page - 1) // page
    vec = (ctypes.c_ubyte * n)()
    if libc.mincore(ctypes.c_void_p(t.data_ptr()), ctypes.c_size_t(n * page), vec) != 0:
        pytest.skip(f"mincore failed: errno {ctypes.get_errno()}")
    return sum(b & 1 for b in vec), n


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore residency as Linux reports it")
def test_numa_zeros_populates_pages_up_front():
    """The KV cache's pages are faulted in when it is allocated (by the
    thread team), not by the first decode step that writes a block; and
    populate=False leaves them to first use."""
    from paged.backends.cpu.host.memory import numa_zeros

    eager = numa_zeros((24 << 20,), torch.uint8)  # 24 MiB: several huge pages, odd ones out
    resident, total = _resident_pages(eager)
    assert resident == total, (resident, total)
    assert not eager[:: 1 << 20].any()
    lazy = numa_zeros((24 << 20,), torch.uint8, populate=False)
    resident, total = _resident_pages(lazy)
    assert resident < total, (resident, total)
    lazy[5 << 20] = 1  # first use still works, and zeros around it
    assert lazy.sum().item() == 1


def test_numa_zeros_reports_fallbacks():
    from paged.backends.cpu.host.memory import last_allocation, numa_zeros

    numa_zeros((2, 3), torch.float16, node=1000)  # no such node: memory still comes, policy not applied
    info = last_allocation()
    assert info["method"] == "host_arena" and info["numa_policy"] == "default" and "1000" in info["reason"]
    assert numa_zeros((0, 3), torch.float32).shape == (0, 3)
    assert last_allocation()["method"] == "torch.zeros"
    with pytest.raises(ValueError, match="-2"):
        numa_zeros((2,), torch.float32, node=-2)
