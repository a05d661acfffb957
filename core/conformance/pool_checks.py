"""Block pool semantics: the platform's block pool class driven through a
seeded random sequence of operations, step by step against the pure-Python
model (core/engine/block_pool_spec.py), plus the bad-use errors."""

from __future__ import annotations

import random

from paged.core.engine.block_pool_spec import BlockPoolModel
from paged.core.conformance.runner import Check, Context


_STATE_FIELDS = ("num_free", "free_queue", "cached_blocks", "stats", "ref_counts")


def _state(pool) -> tuple:
    return (pool.num_free, list(pool.free_queue()), dict(pool.cached_blocks()), dict(pool.stats()),
            [pool.ref_count(b) for b in range(pool.num_blocks)])


def _apply(obj, op: str, args: tuple):
    """(result, exception type name) of one call."""
    try:
        return getattr(obj, op)(*args), None
    except (ValueError, IndexError, RuntimeError) as e:
        return None, type(e).__name__


def _random_op(rng: random.Random, model: BlockPoolModel, hashes: list[int]) -> tuple[str, tuple]:
    n = model.num_blocks
    used = [b for b in range(n) if model.ref_count(b) > 0]
    r = rng.random()
    if r < 0.25:
        return "allocate", (rng.randint(0, max(1, n // 3)),)
    if r < 0.45 and used:
        return "free", (rng.sample(used, rng.randint(1, min(3, len(used)))),)
    if r < 0.52 and used:
        return "incref", ([rng.choice(used)],)
    if r < 0.65 and used:
        b = rng.choice(used)
        h = rng.choice(hashes) if hashes and rng.random() < 0.5 else rng.getrandbits(63)
        hashes.append(h)
        return "register_hash", (b, h)
    if r < 0.75 and hashes:
        k = rng.randint(1, 4)
        return "lookup_prefix", ([rng.choice(hashes) for _ in range(k)],)
    if r < 0.82 and used:
        return "cow", (rng.choice(used),)
    if r < 0.87 and used:
        return "mark_written", (rng.choice(used),)
    # bad use: double free, unknown ids, incref of a free block
    bad = rng.choice([("free", ([rng.choice(range(n))],)), ("free", ([n + rng.randint(0, 5)],)),
                      ("incref", ([-1],)), ("ref_count", (n,)), ("free", ([0, 0, 0],))])
    return bad


def _random_sequence(ctx: Context):
    pool_cls = ctx.pool_cls
    steps = 300 if ctx.quick else 3000
    for num_blocks in (1, 7, 64):
        rng = random.Random(ctx.seed * 1000 + num_blocks)
        pool, model = pool_cls(num_blocks), BlockPoolModel(num_blocks)
        hashes: list[int] = []
        for step in range(steps):
            op, args = _random_op(rng, model, hashes)
            want = _apply(model, op, args)
            got = _apply(pool, op, args)
            if op in ("allocate", "lookup_prefix", "free_queue") and got[0] is not None:
                got = (list(got[0]), got[1])
            if op == "cow" and got[0] is not None:
                got = (tuple(got[0]), got[1])
            assert got == want, (f"num_blocks={num_blocks} step {step}: {op}{args} returned {got[0]!r} "
                                 f"(error {got[1]}) but the model gives {want[0]!r} (error {want[1]})")
            s_pool, s_model = _state(pool), _state(model)
            if s_pool != s_model:
                field = next(f for f, a, b in zip(_STATE_FIELDS, s_pool, s_model) if a != b)
                i = _STATE_FIELDS.index(field)
                raise AssertionError(f"num_blocks={num_blocks} step {step}: after {op}{args} the pool's {field} "
                                     f"differs from the model: {s_pool[i]} vs {s_model[i]}")
            _invariants(pool)
    return None


def _invariants(pool) -> None:
    n = pool.num_blocks
    free = list(pool.free_queue())
    assert len(set(free)) == len(free) == pool.num_free, f"free queue {free} has duplicates or wrong length"
    for b in range(n):
        rc = pool.ref_count(b)
        assert rc >= 0, f"block {b} has ref count {rc}"
        assert (rc == 0) == (b in set(free)), f"block {b}: ref count {rc} but in-free-queue={b in free}"
    for h, b in pool.cached_blocks().items():
        assert pool.block_hash(b) == h, f"cached hash {h} maps to block {b} which holds {pool.block_hash(b)}"


def _bad_use(ctx: Context):
    pool = ctx.pool_cls(4)
    (b,) = pool.allocate(1)
    pool.free([b])
    for call, exc, needle in ((lambda: pool.free([b]), ValueError, str(b)),
                              (lambda: pool.free([99]), IndexError, "99"),
                              (lambda: pool.incref([-3]), IndexError, "-3")):
        try:
            call()
        except exc as e:
            assert needle in str(e), f"{exc.__name__} message {str(e)!r} does not name block {needle}"
        else:
            raise AssertionError(f"no {exc.__name__} for bad use naming block {needle}")
    assert pool.num_free == 4 and sorted(pool.free_queue()) == [0, 1, 2, 3], "a failed call changed the pool"


def checks(ctx: Context) -> list[Check]:
    return [Check("pool.random_ops_vs_model", _random_sequence), Check("pool.bad_use_errors", _bad_use)]
