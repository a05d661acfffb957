"""Stateful test: random allocate / fork / cache / lookup / cow / free /
misuse sequences on the C++ BlockPool and the pure-Python model side by side,
with the pool's invariants checked after every step against the references
the test itself holds."""

from collections import Counter

import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from paged.core.engine.block_pool_spec import BlockPoolModel

C = pytest.importorskip("paged._C_blocks")

NUM_BLOCKS = 12
HASHES = st.integers(0, 5)  # a few values, so lookups hit and registrations collide


def outcome(fn):
    try:
        return ("ok", fn())
    except (ValueError, IndexError, RuntimeError) as e:
        return (type(e).__name__, str(e))


class PoolMachine(RuleBasedStateMachine):
    @initialize()
    def setup(self):
        self.cpp = C.BlockPool(NUM_BLOCKS)
        self.model = BlockPoolModel(NUM_BLOCKS)
        self.seqs: list[list[int]] = []  # block references the test holds, like requests do

    def both(self, call):
        got, want = outcome(lambda: call(self.cpp)), outcome(lambda: call(self.model))
        assert got == want
        return got

    def held(self) -> Counter:
        return Counter(b for seq in self.seqs for b in seq)

    @rule(n=st.integers(0, 5))
    def allocate(self, n):
        kind, blocks = self.both(lambda p: p.allocate(n))
        if kind == "ok" and blocks is not None:
            assert len(blocks) == n
            self.seqs.append(blocks)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def free(self, data):
        seq = self.seqs.pop(data.draw(st.integers(0, len(self.seqs) - 1)))
        assert self.both(lambda p: p.free(seq))[0] == "ok"

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def fork(self, data):
        seq = self.seqs[data.draw(st.integers(0, len(self.seqs) - 1))]
        assert self.both(lambda p: p.incref(seq))[0] == "ok"
        self.seqs.append(list(seq))

    @precondition(lambda self: any(self.seqs))
    @rule(data=st.data(), h=HASHES)
    def register(self, data, h):
        seq = data.draw(st.sampled_from([s for s in self.seqs if s]))
        block = seq[data.draw(st.integers(0, len(seq) - 1))]
        self.both(lambda p: p.register_hash(block, h))

    @rule(hashes=st.lists(HASHES, max_size=4))
    def lookup(self, hashes):
        kind, blocks = self.both(lambda p: p.lookup_prefix(hashes))
        assert kind == "ok"
        self.seqs.append(blocks)

    @precondition(lambda self: any(self.seqs))
    @rule(data=st.data())
    def cow_then_write(self, data):
        seq = data.draw(st.sampled_from([s for s in self.seqs if s]))
        i = data.draw(st.integers(0, len(seq) - 1))
        kind, copy = self.both(lambda p: p.cow(seq[i]))
        if kind == "ok":
            if copy is not None:
                assert copy[0] == seq[i]
                seq[i] = copy[1]
            assert self.both(lambda p: p.mark_written(seq[i]))[0] == "ok"
        else:  # only a full pool may refuse a copy
            assert kind == "RuntimeError" and self.model.num_free == 0

    @rule(block=st.integers(-2, NUM_BLOCKS + 1))
    def misuse_free(self, block):
        held = self.held()[block]
        kind, _ = self.both(lambda p: p.free([block] * (held + 1)))
        assert kind == ("IndexError" if not 0 <= block < NUM_BLOCKS else "ValueError")

    @precondition(lambda self: any(len(s) and self.held()[s[-1]] > 1 for s in self.seqs))
    @rule()
    def misuse_write_shared(self):
        shared = next(s[-1] for s in self.seqs if s and self.held()[s[-1]] > 1)
        assert self.both(lambda p: p.mark_written(shared))[0] == "ValueError"

    @invariant()
    def pools_agree_and_are_consistent(self):
        if not hasattr(self, "cpp"):
            return
        assert self.cpp.stats() == self.model.stats()
        queue = self.cpp.free_queue()
        assert queue == self.model.free_queue()
        assert len(set(queue)) == len(queue)
        held = self.held()
        for b in range(NUM_BLOCKS):
            assert self.cpp.ref_count(b) == held[b]  # ref counts are exactly the references held
            assert (b in queue) == (held[b] == 0)  # never both free and referenced
        s = self.cpp.stats()
        assert s["free"] + s["used"] == NUM_BLOCKS == s["num_blocks"]
        cached = self.cpp.cached_blocks()
        assert cached == self.model.cached_blocks()
        for h, b in cached.items():
            assert self.cpp.block_hash(b) == h


PoolMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestPoolMachine = PoolMachine.TestCase
