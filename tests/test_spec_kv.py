"""Speculative decoding's KV rules (core/engine/kv_cache_manager.py): rejected drafts
leave no trace. A toy KV cache keeps one token id per slot; draft tokens are
written into their slots like the forward would, the rejected ones are rolled
back with ``truncate``, and every request (including later ones whose prompt
hits blocks that once held rejected drafts) must read back exactly its own
verified tokens. Oracle: the requests' token lists."""

import random

import pytest
import torch

from paged.core.engine.block_pool_spec import BlockPoolModel
from paged.core.engine.kv_cache_manager import KVCacheManager

C = pytest.importorskip("paged._C_blocks")
BS = 4


@pytest.fixture(params=[C.BlockPool, BlockPoolModel], ids=["cpp", "model"])
def pool_cls(request):
    return request.param


def write(cache, mgr, rid, tokens, start):
    table = mgr.block_table(rid)
    for i, t in enumerate(tokens):
        pos = start + i
        cache[table[pos // BS], pos % BS] = t


def read(cache, mgr, rid, n):
    table = mgr.block_table(rid)
    return [int(cache[table[p // BS], p % BS]) for p in range(n)]


def test_rejected_drafts_are_not_cached_and_a_later_hit_reads_true_tokens(pool_cls):
    mgr = KVCacheManager(16, BS, pool_cls=pool_cls)
    cache = torch.full((16, BS), -1, dtype=torch.long)
    tokens = [10, 11, 12, 13, 14, 15]  # 6 known tokens, 5 computed; token 15 is the last sampled
    assert mgr.get_computed_tokens("a", tokens) == 0
    mgr.allocate_slots("a", tokens, 0, 5)
    write(cache, mgr, "a", tokens[:5], 0)
    # verify step: token 15 plus drafts 90, 91, 92, 93 at positions 5..9 (blocks 1 and 2)
    assert mgr.allocate_slots("a", tokens, 5, 5) == []
    assert len(mgr.block_table("a")) == 3
    write(cache, mgr, "a", [15, 90, 91, 92, 93], 5)
    # only draft 90 is accepted, the model's token 20 follows: positions 0..6 are verified K/V
    tokens += [90, 20]
    mgr.truncate("a", 7)
    assert len(mgr.block_table("a")) == 2  # block 2 held only rejected drafts: given back
    assert mgr.stats()["cached"] == 1  # block 0 only: block 1 is not full of verified tokens yet
    # the next step computes token 20 over the rejected draft's slot, then one more
    assert mgr.allocate_slots("a", tokens, 7, 1) == []
    write(cache, mgr, "a", [20], 7)
    assert read(cache, mgr, "a", 8) == tokens
    # a new request with a's tokens as its prompt prefix hits both full blocks
    b = tokens + [30, 31]
    assert mgr.get_computed_tokens("b", b) == 8
    mgr.allocate_slots("b", b, 8, 2)
    write(cache, mgr, "b", b[8:], 8)
    assert read(cache, mgr, "b", 10) == b
    # a prompt that repeats the rejected drafts 90, 91 (block 1 as proposed) hits block 0 only
    c = tokens[:6] + [90, 91, 40]
    assert mgr.get_computed_tokens("c", c) == 4
    mgr.allocate_slots("c", c, 4, 5)
    write(cache, mgr, "c", c[4:], 4)
    assert read(cache, mgr, "c", 9) == c and read(cache, mgr, "a", 8) == tokens


def test_truncate_checks_and_frees(pool_cls):
    mgr = KVCacheManager(8, BS, pool_cls=pool_cls)
    mgr.get_computed_tokens("a", [1, 2, 3])
    mgr.allocate_slots("a", [1, 2, 3], 0, 9)
    assert len(mgr.block_table("a")) == 3 and mgr.num_free_blocks == 5
    with pytest.raises(ValueError, match=r"num_tokens: expected 0 <= num_tokens <= 12 .*, got 13"):
        mgr.truncate("a", 13)
    with pytest.raises(KeyError, match="unknown request 'zz'"):
        mgr.truncate("zz", 1)
    mgr.truncate("a", 5)
    assert mgr.block_table("a") == mgr.block_table("a")[:2] and mgr.num_free_blocks == 6
    mgr.truncate("a", 5)  # idempotent
    assert mgr.num_free_blocks == 6
    mgr.free("a")
    assert mgr.num_free_blocks == 8


@pytest.mark.parametrize("seed", range(4))
def test_random_speculation_reads_back_every_request(seed, pool_cls):
    """Admit (often with another request's verified tokens as the prompt, so
    prefix hits land on blocks that held drafts), prefill in chunks, verify
    drafts with a random number accepted, fork, preempt; after every step each
    request's table must read back its verified tokens."""
    rng = random.Random(seed)
    nb = 32
    mgr = KVCacheManager(nb, BS, pool_cls=pool_cls)
    cache = torch.full((nb, BS), -1, dtype=torch.long)
    live: dict[str, tuple[list[int], int]] = {}  # rid -> (verified tokens, num computed)
    proposed: list[list[int]] = [[]]  # verified tokens + drafts as proposed, rejected ones included
    hits = 0
    for step in range(300):
        op = rng.random()
        if op < 0.2 and len(live) < 6:
            rid = f"r{step}"
            if live and rng.random() < 0.5:
                base = list(live[rng.choice(sorted(live))][0])
            else:  # a prompt that repeats rejected drafts: it must not hit their blocks
                base = list(rng.choice(proposed[-8:]))
            tokens = base + [rng.randrange(50) for _ in range(rng.randrange(1, 6))]
            hit = mgr.get_computed_tokens(rid, tokens)
            hits += hit > 0
            live[rid] = (tokens, hit)
        elif op < 0.28 and live:
            parent = rng.choice(sorted(live))
            tokens, done = live[parent]
            if done == len(tokens) - 1:
                mgr.fork(parent, f"f{step}")
                live[f"f{step}"] = (list(tokens), done)
        elif op < 0.36 and live:
            rid = rng.choice(sorted(live))
            mgr.free(rid)
            del live[rid]
        elif live:
            rid = rng.choice(sorted(live))
            tokens, done = live[rid]
            if done < len(tokens) - 1:  # prefill chunk, never past the last known token
                n = min(len(tokens) - 1 - done, rng.randrange(1, 6))
                new, drafts = tokens[done:done + n], []
            else:  # verify: the last known token plus 0..4 drafts
                drafts = [50 + rng.randrange(50) for _ in range(rng.randrange(0, 5))]
                new = tokens[done:] + drafts
            copies = mgr.allocate_slots(rid, tokens, done, len(new))
            if copies is None:
                mgr.free(rid)
                del live[rid]
                continue
            for src, dst in copies:
                cache[dst] = cache[src]
            write(cache, mgr, rid, new, done)
            if drafts:
                proposed.append(tokens + drafts)
            if done < len(tokens) - 1:
                live[rid] = (tokens, done + len(new))
            else:
                accepted = rng.randrange(0, len(drafts) + 1)
                tokens.extend(drafts[:accepted] + [rng.randrange(50)])  # + the model's own token
                done += 1 + accepted
                mgr.truncate(rid, done)
                live[rid] = (tokens, done)
        for rid, (tokens, done) in live.items():
            assert read(cache, mgr, rid, done) == tokens[:done], (rid, step)
            assert len(mgr.block_table(rid)) <= -(-max(done, 1) // BS) + 1
        assert mgr.num_free_blocks + mgr.stats()["used"] == nb
    for rid in list(live):
        mgr.free(rid)
    assert mgr.num_free_blocks == nb and hits > 0
