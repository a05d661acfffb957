"""Tensor-parallel ranks as threads of one process, taking turns.

``ThreadRanks(n).run(fns)`` runs ``fns[r](comm_r)`` for every rank r, each
in its own thread, where ``comm_r`` has the interface of
core/engine/distributed/group.py's Collectives (``all_reduce``, ``all_gather_cat``).
Exactly one rank computes at a time: rank 0 until its first collective,
then rank 1 up to the same collective, and so on; the last rank to arrive
combines the contributions (sums in rank order, concatenations in rank
order) and hands the turn back to rank 0. So shared scratch memory and the
C++ kernels' thread pool are never used by two ranks at once, and a run is
deterministic.

What it is for: running the real sharded model (the same sharding, the same
TensorParallelOps) in one process, to compare every rank's hidden states
with a single process layer by layer (tests, benchmarks/tp_divergence.py).
Serving uses processes (group.py).
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F


class ThreadRanks:
    def __init__(self, world_size: int):
        if world_size < 1:
            raise ValueError(f"world_size: expected >= 1, got {world_size}")
        self.world_size = world_size
        self._cv = threading.Condition()
        self._turn = 0
        self._slots: list = [None] * world_size
        self._results: dict[int, list] = {}
        self._failed: BaseException | None = None

    def comm(self, rank: int) -> "ThreadCollectives":
        return ThreadCollectives(self, rank)

    def run(self, fns) -> list:
        """fns[r](comm_r) on rank r's thread; their results in rank order.
        The first exception is raised here once every thread has ended."""
        if len(fns) != self.world_size:
            raise ValueError(f"fns: expected {self.world_size} callables, got {len(fns)}")
        results: list = [None] * self.world_size

        def body(rank: int) -> None:
            try:
                self._wait_turn(rank)
                results[rank] = fns[rank](self.comm(rank))
                self._pass_turn(rank)
            except BaseException as exc:  # noqa: BLE001 - re-raised by run()
                with self._cv:
                    self._failed = self._failed or exc
                    self._cv.notify_all()

        threads = [threading.Thread(target=body, args=(r,), name=f"tp-rank-{r}") for r in range(self.world_size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if self._failed is not None:
            raise self._failed
        return results

    # -- turns -----------------------------------------------------------------
    def _wait_turn(self, rank: int) -> None:
        with self._cv:
            self._cv.wait_for(lambda: self._turn == rank or self._failed is not None)
            if self._failed is not None:
                raise RuntimeError(f"rank {rank}: another rank failed")

    def _pass_turn(self, rank: int) -> None:
        with self._cv:
            self._turn = (rank + 1) % self.world_size
            self._cv.notify_all()

    def exchange(self, rank: int, generation: int, value, combine):
        """Deposits ``value`` for collective ``generation``; returns
        combine(every rank's value) once all have deposited, in turn."""
        with self._cv:
            self._slots[rank] = value
            if rank == self.world_size - 1:
                self._results[generation] = [combine(self._slots), self.world_size]
                self._slots = [None] * self.world_size
        self._pass_turn(rank)
        self._wait_turn(rank)
        with self._cv:
            entry = self._results[generation]
            entry[1] -= 1
            if entry[1] == 0:
                del self._results[generation]
            return entry[0]


class ThreadCollectives:
    """One rank's view of a ThreadRanks group (Collectives' interface)."""

    def __init__(self, ranks: ThreadRanks, rank: int):
        self.ranks, self.rank = ranks, rank
        self._generation = 0

    def _exchange(self, value, combine):
        self._generation += 1
        return self.ranks.exchange(self.rank, self._generation, value, combine)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        def total(parts):
            out = parts[0].clone()
            for p in parts[1:]:
                out += p
            return out

        return self._exchange(t.contiguous(), total).clone()

    def all_gather_cat(self, local: torch.Tensor, sizes: tuple[int, ...]) -> torch.Tensor:
        width = max(sizes)
        padded = F.pad(local, (0, width - local.shape[-1])).contiguous()
        parts = self._exchange(padded, lambda ps: [p.clone() for p in ps])
        return torch.cat([p[..., :n] for p, n in zip(parts, sizes)], dim=-1)
