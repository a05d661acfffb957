"""The tensor-parallel rank group: launch or join, collectives, failure.

One process per rank. Rank 0 runs the engine (scheduler, tokenizer, API);
the others follow its steps (core/engine/distributed/rank.py). Two ways to form a group:

- one machine: rank 0 spawns ranks 1..N-1 (torch.multiprocessing, spawn)
  and holds the rendezvous store; each child announces itself there;
- torchrun (or MASTER_ADDR / MASTER_PORT / RANK / WORLD_SIZE set by hand):
  every process joins through torch's env:// rendezvous.

Collectives run through torch.distributed with the platform's backend
(``Platform.dist_backend``: gloo on the CPU, nccl on CUDA, hccl on the NPU).
Rank 0 sends each step's inputs over a second, gloo (host) group with a long
timeout, so followers may wait through an idle server; the compute group
times out after PAGED_TP_TIMEOUT seconds. A rank that does not join within
PAGED_TP_JOIN_TIMEOUT seconds, or that dies, ends the group with one error
naming it (gloo reports a closed peer at once; rank 0 also watches the
processes it spawned).
"""

from __future__ import annotations

import datetime
import importlib
import logging
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

from paged.core.engine.distributed.layout import INITIAL_AFFINITY, RankFailed, resolve_size, torchrun_env

#: seconds every rank has to join the group (model loading comes after)
JOIN_TIMEOUT_S = float(os.environ.get("PAGED_TP_JOIN_TIMEOUT", "120"))
#: seconds a collective may wait for a rank that is alive but stuck
OP_TIMEOUT_S = float(os.environ.get("PAGED_TP_TIMEOUT", "300"))
#: the step channel: followers wait here while the server is idle
CONTROL_TIMEOUT = datetime.timedelta(days=365)
#: what a spawned rank runs once it has joined (named, so this module stays below the engine)
RANK_ENTRY = "paged.core.engine.distributed.rank:follow"


class Collectives:
    """The operations where sharded ranks meet, over one process group.
    Counts the calls and the time spent in them (benchmarks/tensor_parallel.py)."""

    def __init__(self, group=None):
        self.group = group
        self.collective_s = 0.0
        self.collective_calls = 0

    def _count(self, t0: float) -> None:
        self.collective_s += time.perf_counter() - t0
        self.collective_calls += 1

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        t = t.contiguous()
        dist.all_reduce(t, group=self.group)
        self._count(t0)
        return t

    def all_gather_cat(self, local: torch.Tensor, sizes: tuple[int, ...]) -> torch.Tensor:
        """Every rank's ``local`` [..., sizes[r]] concatenated along the last
        dimension (padded to the widest for the collective)."""
        t0 = time.perf_counter()
        width = max(sizes)
        padded = F.pad(local, (0, width - local.shape[-1])).contiguous()
        parts = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(parts, padded, group=self.group)
        out = torch.cat([p[..., :n] for p, n in zip(parts, sizes)], dim=-1)
        self._count(t0)
        return out


@dataclass
class RankGroup:
    """This process's place in the group. ``world_size == 1``: no group (no
    collectives at all). ``children``: the ranks rank 0 spawned."""

    rank: int = 0
    world_size: int = 1
    backend: str = ""
    launcher: str = "single"  # single | spawn | torchrun
    comm: Collectives | None = None
    control: object = None
    local_rank: int = 0  # the device index on this machine
    local_world_size: int = 1  # ranks on this machine (CPU placement splits its cores among them)
    children: dict[int, object] = field(default_factory=dict)
    on_failure: object = None  # callable(message), run once when a spawned rank dies (the server exits)
    stopped: str | None = None  # why the group stopped, once it has
    store: object = None  # rank 0's rendezvous store (kept alive while the group is)

    def broadcast_object(self, obj=None):
        """Rank 0's ``obj`` on every rank (over the control group)."""
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def min_int(self, value: int) -> int:
        """The smallest ``value`` over the ranks (over the host control
        group: a CPU tensor whatever the compute backend)."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control)
        return int(t.item())

    def dead_rank(self) -> str | None:
        """'tensor parallel rank R exited with code C' for the first spawned
        rank that ended, else None."""
        for rank, proc in self.children.items():
            if proc.exitcode is not None:
                how = (f"was killed by signal {-proc.exitcode}" if proc.exitcode < 0
                       else f"exited with code {proc.exitcode}")
                return f"tensor parallel rank {rank} {how}"
        return None

    def failure(self, exc: BaseException) -> RankFailed:
        """Rank 0, after a step failed: the group is unusable (the other ranks
        are inside the step's collectives). The error names the rank that
        died where rank 0 spawned it (its exit code takes a moment to show)."""
        deadline = time.monotonic() + 2.0
        while self.children and self.dead_rank() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        cause = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}"
        who = self.dead_rank()
        self.stopped = self.stopped or (f"{who}; the tensor parallel group has stopped ({cause})" if who else
                                        f"a tensor parallel step failed; the group has stopped ({cause})")
        return RankFailed(self.stopped)

    def watch(self, interval_s: float = 0.2) -> None:
        """Rank 0: a daemon thread that notices a spawned rank's death and
        runs ``on_failure`` with the message (the server sets it)."""
        def loop():
            while self.children and self.dead_rank() is None:
                time.sleep(interval_s)
            if self.children and self.on_failure is not None:
                self.on_failure(self.dead_rank())
        threading.Thread(target=loop, name="paged-tp-watch", daemon=True).start()

    def stop_process_on_failure(self) -> None:
        """Rank 0 of a server: when a spawned rank dies, print one error
        naming it and end this process (the others then see rank 0 gone and
        exit), instead of serving errors. Nothing for one rank."""
        def stop(message: str) -> None:
            print(f"paged: error: {message}; the server stops", file=sys.stderr, flush=True)
            os._exit(1)

        if self.children:
            self.on_failure = stop
            self.watch()

    def abort(self, exc: BaseException) -> BaseException:
        """Start-up failed with ``exc``: the other ranks are stopped; returns
        the error to raise (a RankFailed naming a rank that died, else ``exc``)."""
        error = exc
        if self.world_size > 1 and isinstance(exc, RuntimeError) and not isinstance(exc, RankFailed):
            error = self.failure(exc)
        self.shutdown(grace_s=0)
        return error

    def shutdown(self, grace_s: float = 5.0) -> None:
        """Ends the group: spawned ranks are joined (stopped after
        ``grace_s``), the process groups destroyed, so a later engine in this
        process may form a new one."""
        children, self.children = self.children, {}
        for proc in children.values():
            proc.join(timeout=grace_s)
            if proc.exitcode is None:
                proc.terminate()
                proc.join(timeout=5.0)
        if self.comm is not None and dist.is_initialized():
            dist.destroy_process_group()
        self.comm = self.control = self.store = None
        self.stopped = self.stopped or "the tensor parallel group was shut down"


def start_group(config, platform) -> RankGroup:
    """Rank 0's group for ``config.tensor_parallel_size`` (an int or
    "auto"): none for 1, torchrun's when its environment is set, else
    spawned ranks. The other ranks receive ``config`` from here."""
    group = _form(config.tensor_parallel_size, platform)
    if group.world_size > 1:
        group.broadcast_object(config)
    return group


def _form(tensor_parallel_size, platform) -> RankGroup:
    size = resolve_size(tensor_parallel_size, platform)
    env = torchrun_env()
    if env is not None and env[1] > 1:
        if env[0] != 0:
            raise ValueError(f"RANK {env[0]}: only rank 0 runs the engine; the others run 'paged' under "
                             "torchrun, which makes them follow rank 0")
        if tensor_parallel_size not in (1, "auto", env[1]):
            raise ValueError(f"tensor_parallel_size: expected torchrun's WORLD_SIZE ({env[1]}), "
                             f"got {tensor_parallel_size}")
        return join_torchrun(platform.dist_backend)
    if size == 1:
        return RankGroup()
    return spawn_group(size, platform.dist_backend)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init(backend: str, rank: int, world_size: int, launcher: str, local: tuple[int, int], **init) -> RankGroup:
    """Joins; ``local`` is (rank, ranks) on this machine."""
    dist.init_process_group(backend, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=OP_TIMEOUT_S), **init)
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    return RankGroup(rank, world_size, backend, launcher, Collectives(), control, *local)


def spawn_group(world_size: int, backend: str) -> RankGroup:
    """Rank 0 on one machine: starts ranks 1..N-1 and waits for each to
    announce itself (RankFailed naming the first that died or is late)."""
    import torch.multiprocessing as mp

    if dist.is_initialized():
        raise ValueError("tensor_parallel_size: expected one tensor parallel engine per process, got a second "
                         "while the first is open (close() it first)")
    port = _free_port()
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=JOIN_TIMEOUT_S))
    ctx = mp.get_context("spawn")
    children = {}
    pinned = os.sched_getaffinity(0)
    if INITIAL_AFFINITY:  # a child inherits this thread's mask: give it the process's, not the pinned one
        os.sched_setaffinity(0, INITIAL_AFFINITY)
    try:
        for rank in range(1, world_size):
            proc = ctx.Process(target=_spawned_main, args=(rank, world_size, port, backend, _log_level()),
                               name=f"paged-rank-{rank}", daemon=True)
            proc.start()
            children[rank] = proc
    finally:
        os.sched_setaffinity(0, pinned)
    group = RankGroup(children=children)
    try:
        _await_joins(store, group, world_size)
        joined = _init(backend, 0, world_size, "spawn", (0, world_size), store=store)
    except BaseException:
        group.shutdown(grace_s=0)
        raise
    joined.children, joined.store = children, store
    return joined


def _await_joins(store, group: RankGroup, world_size: int) -> None:
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    missing = list(range(1, world_size))
    while missing:
        missing = [r for r in missing if not store.check([f"paged/joined/{r}"])]
        dead = group.dead_rank()
        if dead:
            raise RankFailed(f"{dead} before joining the group (see its error above)")
        if missing and time.monotonic() > deadline:
            raise RankFailed(f"tensor parallel rank {missing[0]} did not join within {JOIN_TIMEOUT_S:g} s "
                             "(PAGED_TP_JOIN_TIMEOUT)")
        time.sleep(0.02)


def _log_level() -> int:
    return logging.getLogger("paged").getEffectiveLevel()


def _spawned_main(rank: int, world_size: int, port: int, backend: str, log_level: int) -> None:
    """A spawned rank: join rank 0's store, then follow its steps."""
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s rank {rank} %(name)s: %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("paged").setLevel(max(log_level, logging.WARNING))
    try:
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False,
                              timeout=datetime.timedelta(seconds=JOIN_TIMEOUT_S))
        store.set(f"paged/joined/{rank}", "1")
        group = _init(backend, rank, world_size, "spawn", (rank, world_size), store=store)
        _run_entry(group)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # nothing left to clean up: skip a second of interpreter teardown
    except KeyboardInterrupt:
        sys.exit(1)
    except Exception as exc:  # noqa: BLE001 - one line on stderr, the exit code tells rank 0
        print(f"paged: error: tensor parallel rank {rank}: {type(exc).__name__}: {exc}", file=sys.stderr,
              flush=True)
        sys.exit(1)


def join_torchrun(backend: str) -> RankGroup:
    """Joins through torchrun's environment (env:// rendezvous)."""
    rank, world_size = torchrun_env()
    local = (int(os.environ.get("LOCAL_RANK", rank)), int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))
    return _init(backend, rank, world_size, "torchrun", local, init_method="env://")


def _run_entry(group: RankGroup) -> None:
    module, _, name = RANK_ENTRY.partition(":")
    getattr(importlib.import_module(module), name)(group)
