"""Which cores the engine's pinned threads should keep, given other processes.

One pinned OpenMP thread per core makes every parallel region wait for its
slowest thread. When another process takes one of two cores, our thread
there spends half its time queued behind it and single-stream decode fell
to 0.31-0.45x, while one thread on the free core holds its own speed
(benchmarks/cpu_contention.py, docs/platforms.md). So, while the engine
runs, ``LoadWatch.poll`` (called before every step, acting about once a
second) reads how long each pinned thread waited on its CPU's run queue
(/proc/self/task/*/schedstat: the harm itself, not a guess from others'
CPU time, which a process of lower priority also runs up) and:

- drops a core whose thread waited SHED of the time or more, not counting
  what our own unpinned threads ran meanwhile (a server's event loop and
  tokenizer share the cores with the team: at 16 streams they alone made
  the team wait ~30% and shed a core it needed, 152 against 243 tok/s);
- takes a dropped core back once it is nearly idle (/proc/stat busy below
  READMIT), or on trial after PROBE_S, doubling the trial's wait each time
  it fails (a busy machine may still leave room: the queue wait tells).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from paged.backends.cpu.host.cpulist import format_cpulist, parse_cpulist

log = logging.getLogger(__name__)

#: run-queue wait share at which a core is dropped: with two threads the team
#: runs at about the speed of the more delayed one, and one thread alone
#: decodes at ~0.65x of two here (a 50% share gave 0.31-0.45x)
SHED = 0.2
READMIT = 0.1  # busy share below which a dropped core is free again
INTERVAL_S = 1.0  # one reading per second costs well under a millisecond
MAX_AGE_S = 5.0  # an older reading (the engine sat idle) only starts a new window
PROBE_S, MAX_PROBE_S = 10.0, 320.0


@dataclass(frozen=True)
class Reading:
    """At ``time`` (seconds): per CPU, busy and total clock ticks over all
    processes (/proc/stat); per thread of ours pinned to one CPU, (that CPU,
    nanoseconds it waited on the run queue); per thread of ours that may run
    on several CPUs, nanoseconds it ran."""

    time: float
    busy: dict[int, int]
    total: dict[int, int]
    waits: dict[int, tuple[int, int]] = field(default_factory=dict)
    own_runs: dict[int, int] = field(default_factory=dict)


def parse_proc_stat(text: str) -> tuple[dict[int, int], dict[int, int]]:
    """(busy, total) ticks per CPU from /proc/stat's "cpuN" lines. Busy
    counts steal too: a hypervisor's steal delays a pinned thread the same."""
    busy, total = {}, {}
    for line in text.splitlines():
        name, _, rest = line.partition(" ")
        if not (name.startswith("cpu") and name[3:].isdigit()):
            continue
        user, nice, system, idle, iowait, irq, softirq, steal = (int(v) for v in rest.split()[:8])
        cpu = int(name[3:])
        busy[cpu] = user + nice + system + irq + softirq + steal
        total[cpu] = busy[cpu] + idle + iowait
    return busy, total


def pinned_cpu(status: str) -> int | None:
    """The CPU a thread is pinned to, from its /proc status; None when it may
    run on several."""
    for line in status.splitlines():
        if line.startswith("Cpus_allowed_list:"):
            cpus = parse_cpulist(line.split(":", 1)[1])
            return cpus[0] if len(cpus) == 1 else None
    return None


def read_proc(proc_root: str | os.PathLike = "/proc", clock: Callable[[], float] = time.monotonic) -> Reading:
    root = Path(proc_root)
    busy, total = parse_proc_stat((root / "stat").read_text())
    waits, own_runs = {}, {}
    for task in (root / "self" / "task").iterdir():
        try:
            cpu = pinned_cpu((task / "status").read_text())
            ran, waited = (int(v) for v in (task / "schedstat").read_text().split()[:2])
            if cpu is not None:
                waits[int(task.name)] = (cpu, waited)
            else:
                own_runs[int(task.name)] = ran
        except (OSError, ValueError, IndexError):  # the thread ended meanwhile
            continue
    return Reading(clock(), busy, total, waits, own_runs)


def wait_shares(before: Reading, after: Reading) -> dict[int, float]:
    """Per CPU, the share of the time between two readings that our thread(s)
    pinned to it spent waiting to run, less what our own unpinned threads ran
    meanwhile: they may have been what it waited for (on whichever CPU, so
    each CPU is credited all of it), and dropping a core does not stop them."""
    waited: dict[int, int] = {}
    for tid, (cpu, ns) in after.waits.items():
        prev_cpu, prev_ns = before.waits.get(tid, (cpu, 0))
        if prev_cpu == cpu:  # a thread pinned elsewhere before: its wait was not here
            waited[cpu] = waited.get(cpu, 0) + ns - prev_ns
    own = sum(ns - before.own_runs[tid] for tid, ns in after.own_runs.items() if tid in before.own_runs)
    elapsed_ns = (after.time - before.time) * 1e9
    return {cpu: min(1.0, max(0, ns - own) / elapsed_ns) for cpu, ns in waited.items()}


def busy_shares(before: Reading, after: Reading) -> dict[int, float]:
    """Per CPU, the share of the time between two readings it was busy (any process)."""
    shares = {}
    for cpu, total in after.total.items():
        elapsed = total - before.total.get(cpu, total)
        if elapsed > 0:
            shares[cpu] = min(1.0, (after.busy[cpu] - before.busy.get(cpu, 0)) / elapsed)
    return shares


def choose_cpus(candidates: list[int], current: list[int], waits: dict[int, float],
                busy: dict[int, float], trial: set[int] = frozenset()) -> list[int]:
    """The CPUs of ``candidates`` to run on: those of ``current`` whose
    thread waited less than SHED, and the others that are nearly idle or on
    ``trial``; the least delayed current one when none qualifies."""
    keep = [c for c in candidates if (waits.get(c, 0.0) < SHED if c in current
                                      else busy.get(c, 1.0) < READMIT or c in trial)]
    return keep or [min(current, key=lambda c: (waits.get(c, 0.0), c))]


class LoadWatch:
    """Polled before every step: a new CPU list when the team should change,
    else None."""

    def __init__(self, candidates: list[int], read: Callable[[], Reading] = read_proc):
        self.candidates = list(candidates)
        self._read = read
        self._dropped: dict[int, float] = {}  # CPU -> when it was dropped
        self._probe_after: dict[int, float] = {}  # CPU -> seconds out before a trial
        self._on_trial: set[int] = set()
        self._last = self._reading()

    def _reading(self) -> Reading | None:
        try:
            return self._read()
        except (OSError, ValueError) as e:  # no /proc, or no schedstat in this kernel
            log.debug("CPU load not readable (%s): threads stay on CPUs %s", e, format_cpulist(self.candidates))
            return None

    def poll(self, current: list[int], now: float | None = None) -> list[int] | None:
        now = time.monotonic() if now is None else now
        if self._last is None or now - self._last.time < INTERVAL_S:
            return None
        before, after = self._last, self._reading()
        self._last = after
        if after is None or after.time - before.time > MAX_AGE_S:
            return None
        waits = wait_shares(before, after)
        trial = {c for c, since in self._dropped.items() if after.time - since >= self._probe_after[c]}
        chosen = choose_cpus(self.candidates, current, waits, busy_shares(before, after), trial)
        if chosen == current:
            self._on_trial.clear()
            return None
        self._record(current, chosen, after.time)
        _log_change(current, chosen, waits, after.time - before.time, retried=self._on_trial & set(current))
        self._on_trial = (set(chosen) - set(current)) & trial
        return chosen

    def _record(self, old: list[int], new: list[int], now: float) -> None:
        for cpu in set(old) - set(new):  # dropped: a failed trial waits twice as long
            failed = cpu in self._on_trial
            self._probe_after[cpu] = min(MAX_PROBE_S, 2 * self._probe_after[cpu]) if failed else PROBE_S
            self._dropped[cpu] = now
        for cpu in set(new) - set(old):
            self._dropped.pop(cpu, None)


def _log_change(old: list[int], new: list[int], waits: dict[int, float], seconds: float,
                retried: set[int]) -> None:
    dropped, added = set(old) - set(new), set(new) - set(old)
    running = (f"running {len(new)} thread(s) on CPU {format_cpulist(new)} "
               f"(was {len(old)} on CPU {format_cpulist(old)})")
    if dropped:
        shares = ", ".join(f"CPU {c} {waits.get(c, 0.0):.0%}" for c in sorted(dropped))
        level = logging.INFO if dropped <= retried else logging.WARNING  # a failed trial is no news
        log.log(level, "CPU %s busy with other processes (our thread waited to run %s of %.1f s): %s "
                "(--cpu-threads-bind auto; a CPU list pins regardless)",
                format_cpulist(dropped), shares, seconds, running)
    else:
        log.info("CPU %s may be free again: %s", format_cpulist(added), running)
