"""KVCacheManager: prefix caching, salts, the last-token rule, CoW on fork,
release, capacity. The end-to-end test keeps a toy KV cache (one token id per
slot) and checks that reading every request's block table gives back exactly
its tokens: the oracle is the requests' own token lists."""

import random

import pytest
import torch

from paged.core.engine.block_pool_spec import BlockPoolModel
from paged.core.engine.kv_cache_manager import KVCacheManager
from paged.core.engine.worker import blocks_for_budget as num_blocks_for_budget

C = pytest.importorskip("paged._C_blocks")
BS = 4


@pytest.fixture(params=[C.BlockPool, BlockPoolModel], ids=["cpp", "model"])
def mgr(request):
    return KVCacheManager(16, BS, pool_cls=request.param)


def admit(mgr, rid, tokens, extra_key=None):
    hit = mgr.get_computed_tokens(rid, tokens, extra_key)
    assert mgr.allocate_slots(rid, tokens, hit, len(tokens) - hit) == []
    return hit


def test_prefix_hit_and_miss(mgr):
    prompt = list(range(100, 110))  # 10 tokens: blocks [4][4][2]
    assert admit(mgr, "a", prompt) == 0
    a = mgr.block_table("a")
    assert len(a) == 3
    assert admit(mgr, "b", prompt) == 8  # both full blocks reused
    assert mgr.block_table("b")[:2] == a[:2] and mgr.block_table("b")[2] != a[2]
    assert admit(mgr, "c", [1] + prompt[1:]) == 0  # first block differs: the chain misses
    assert admit(mgr, "d", prompt[:4] + [7] * 6) == 4  # shares only the first block
    s = mgr.stats()
    assert s["prefix_hits"] == 3 and s["prefix_queries"] == 8 and s["hit_rate"] == pytest.approx(3 / 8)


def test_cached_blocks_survive_free_until_evicted(mgr):
    prompt = list(range(9))
    admit(mgr, "a", prompt)
    first = mgr.block_table("a")[:2]
    mgr.free("a")
    assert mgr.num_free_blocks == 16 and mgr.stats()["cached"] == 2
    assert admit(mgr, "b", prompt) == 8 and mgr.block_table("b")[:2] == first
    mgr.free("b")
    assert mgr.allocate_slots("big", list(range(1000, 1064)), 0, 64) == []  # takes every block: evicts the cache
    mgr.free("big")
    assert mgr.get_computed_tokens("c", prompt) == 0


def test_extra_key_separates_caches(mgr):
    prompt = list(range(9))
    admit(mgr, "a", prompt, extra_key="alice")
    assert admit(mgr, "b", prompt, extra_key="bob") == 0
    assert admit(mgr, "c", prompt) == 0
    assert admit(mgr, "d", prompt, extra_key="alice") == 8


@pytest.mark.parametrize("length,expected", [(1, 0), (4, 0), (5, 4), (8, 4), (9, 8)])
def test_last_prompt_token_is_always_recomputed(mgr, length, expected):
    prompt = list(range(50, 50 + length))
    admit(mgr, "a", prompt + [0] * 4)  # caches every full block of this prompt and more
    assert mgr.get_computed_tokens("b", prompt) == expected
    assert expected <= length - 1


def test_decode_registers_blocks_as_they_fill(mgr):
    tokens = list(range(3))
    admit(mgr, "a", tokens)
    for t in range(3, 9):  # decode steps: one token each
        tokens.append(t)
        assert mgr.allocate_slots("a", tokens, len(tokens) - 1, 1) == []
    assert len(mgr.block_table("a")) == 3
    assert mgr.get_computed_tokens("b", tokens + [99]) == 8


def test_fork_copies_the_shared_partial_block_on_first_write(mgr):
    prompt = list(range(6))  # blocks [4][2]
    admit(mgr, "p", prompt)
    mgr.fork("p", "c")
    parent = mgr.block_table("p")
    assert mgr.block_table("c") == parent
    assert all(mgr.pool.ref_count(b) == 2 for b in parent)
    copies = mgr.allocate_slots("c", prompt + [7], 6, 1)
    child = mgr.block_table("c")
    assert copies == [(parent[1], child[1])] and child[0] == parent[0] and child[1] != parent[1]
    assert mgr.allocate_slots("p", prompt + [8], 6, 1) == []  # parent is the sole owner now
    assert mgr.block_table("p") == parent
    mgr.free("p")
    mgr.free("c")
    assert mgr.num_free_blocks == 16


def test_out_of_blocks_changes_nothing_and_free_returns_all(mgr):
    admit(mgr, "a", list(range(40)))  # 10 blocks
    mgr.fork("a", "b")
    before = (mgr.num_free_blocks, mgr.block_table("a"), mgr.stats())
    assert not mgr.can_allocate(7 * BS) and mgr.can_allocate(6 * BS)
    assert mgr.allocate_slots("x", list(range(100, 128)), 0, 28) is None
    assert (mgr.num_free_blocks, mgr.block_table("a"), mgr.stats()) == before
    mgr.free("a")
    mgr.free("b")
    mgr.free("x")
    mgr.free("never-seen")
    assert mgr.num_free_blocks == mgr.num_blocks == 16 and mgr.stats()["used"] == 0


def test_bad_arguments_name_the_value(mgr):
    with pytest.raises(ValueError, match="-1"):
        mgr.allocate_slots("a", [1, 2], 0, -1)
    with pytest.raises(ValueError, match="num_computed_tokens 8"):
        mgr.allocate_slots("a", [1, 2], 8, 1)
    with pytest.raises(KeyError, match="nope"):
        mgr.block_table("nope")
    with pytest.raises(KeyError, match="nope"):
        mgr.fork("nope", "x")
    admit(mgr, "a", [1, 2, 3])
    with pytest.raises(ValueError, match="'a' already holds"):
        mgr.get_computed_tokens("a", [1, 2, 3])
    with pytest.raises(ValueError, match="block_size"):
        KVCacheManager(4, 0)


def test_capacity_math():
    from paged.backends.reference.attention import ReferenceBackend

    backend = ReferenceBackend(8, 2, 64, 16, torch.bfloat16, "cpu")
    per_block = backend.bytes_per_block(num_layers=24)
    assert per_block == 2 * 24 * 16 * 2 * 64 * 2
    assert num_blocks_for_budget(10 * per_block + per_block - 1, per_block) == 10
    with pytest.raises(ValueError, match=f"KV cache budget: expected at least one block \\({per_block} bytes\\), "
                                         f"got {per_block - 1} bytes"):
        num_blocks_for_budget(per_block - 1, per_block)
    with pytest.raises(ValueError, match="bytes_per_block"):
        num_blocks_for_budget(100, 0)


@pytest.mark.parametrize("seed", range(4))
def test_random_workload_reads_back_every_request(seed):
    """Admit / prefill in chunks / decode / fork / preempt at random with a toy
    KV cache; after every step each request's table must read back its tokens."""
    rng = random.Random(seed)
    mgr = KVCacheManager(24, BS)
    cache = torch.full((24, BS), -1, dtype=torch.long)
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(5, 12))] for _ in range(3)]
    live: dict[str, tuple[list[int], int]] = {}  # rid -> (tokens, num computed)

    def write(rid, tokens, start, end):
        table = mgr.block_table(rid)
        for pos in range(start, end):
            cache[table[pos // BS], pos % BS] = tokens[pos]

    for step in range(200):
        op = rng.random()
        if op < 0.25 and len(live) < 6:
            rid = f"r{step}"
            tokens = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 8))]
            live[rid] = (tokens, mgr.get_computed_tokens(rid, tokens, extra_key="s" if rng.random() < 0.2 else None))
        elif op < 0.35 and live:
            parent = rng.choice(sorted(live))
            tokens, done = live[parent]
            if done == len(tokens):
                mgr.fork(parent, f"f{step}")
                live[f"f{step}"] = (list(tokens), done)
        elif op < 0.45 and live:
            rid = rng.choice(sorted(live))
            mgr.free(rid)  # finish or preempt
            del live[rid]
        elif live:
            rid = rng.choice(sorted(live))
            tokens, done = live[rid]
            if done == len(tokens):
                tokens.append(rng.randrange(50))  # sampled token: decode it next
            n = min(len(tokens) - done, rng.randrange(1, 6))  # chunked prefill / decode
            copies = mgr.allocate_slots(rid, tokens, done, n)
            if copies is None:
                mgr.free(rid)  # preempt: recompute later
                del live[rid]
                continue
            for src, dst in copies:  # the runner's copy_blocks, before the forward
                cache[dst] = cache[src]
            write(rid, tokens, done, done + n)
            live[rid] = (tokens, done + n)
        for rid, (tokens, done) in live.items():
            table = mgr.block_table(rid)
            got = [int(cache[table[p // BS], p % BS]) for p in range(done)]
            assert got == tokens[:done], (rid, step)
        assert mgr.num_free_blocks + mgr.stats()["used"] == 24
    for rid in list(live):
        mgr.free(rid)
    assert mgr.num_free_blocks == 24 and mgr.stats()["prefix_hits"] > 0
