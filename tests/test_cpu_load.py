"""The CPU platform's contention rule (backends/cpu/host/load.py) on synthetic
/proc readings: which waits and ticks count, which cores are dropped, taken
back and tried again, what is logged; and, on the real runtime, that the
OpenMP team follows the decision. Timing itself is benchmarks/cpu_contention.py."""

from __future__ import annotations

import logging
import os

import pytest

from paged.platforms.cpu import CpuPlatform
from paged.backends.cpu.host.load import (PROBE_S, LoadWatch, Reading, busy_shares, choose_cpus,
                                      parse_proc_stat, pinned_cpu, read_proc, wait_shares)

PROC_STAT = """cpu  300 0 100 500 0 0 0 0 0 0
cpu0 100 0 50 240 10 0 0 0 0 0
cpu1 200 5 50 10 0 3 2 30 0 0
intr 12345 0 0
ctxt 999
"""


def test_parse_proc_stat():
    busy, total = parse_proc_stat(PROC_STAT)
    assert busy == {0: 150, 1: 290}  # user nice system irq softirq steal
    assert total == {0: 400, 1: 300}  # + idle + iowait


def test_pinned_cpu():
    assert pinned_cpu("Name:\tpython\nCpus_allowed:\t2\nCpus_allowed_list:\t1\n") == 1
    assert pinned_cpu("Cpus_allowed_list:\t0-1\n") is None


def test_read_proc_from_a_tree(tmp_path):
    (tmp_path / "stat").write_text(PROC_STAT)
    for tid, (cpus, wait) in {11: ("0", 500), 12: ("1", 70), 13: ("0-1", 9)}.items():
        task = tmp_path / "self" / "task" / str(tid)
        task.mkdir(parents=True)
        (task / "status").write_text(f"Name:\tpython\nCpus_allowed_list:\t{cpus}\n")
        (task / "schedstat").write_text(f"123456 {wait} 42\n")
    reading = read_proc(tmp_path, clock=lambda: 7.0)
    assert reading.waits == {11: (0, 500), 12: (1, 70)}  # 13 is not pinned
    assert reading.own_runs == {13: 123456}  # ... so what it ran is counted instead
    assert (reading.time, reading.busy, reading.total) == (7.0, {0: 150, 1: 290}, {0: 400, 1: 300})


def test_wait_shares_per_pinned_cpu():
    before = Reading(0.0, {}, {}, {1: (0, 0), 2: (1, 100), 4: (0, 10**9)})
    # 2 waited 0.5 s of 2 s; 3 is new, pinned to 1; 4 was re-pinned from 0 to 1
    after = Reading(2.0, {}, {}, {1: (0, 0), 2: (1, 100 + 5 * 10**8), 3: (1, 10**8), 4: (1, 2 * 10**9)})
    assert wait_shares(before, after) == {0: 0.0, 1: 0.3}


def test_wait_shares_discount_our_own_unpinned_threads():
    """What our own unpinned threads (a server's event loop, the tokenizer)
    ran may be what the team waited for: it is taken off every CPU's wait,
    never below zero; a thread that ended or started meanwhile counts only
    over what both readings saw."""
    before = Reading(0.0, {}, {}, {1: (0, 0), 2: (1, 0)}, {7: 10**8, 8: 5 * 10**8})
    after = Reading(1.0, {}, {}, {1: (0, 3 * 10**8), 2: (1, 5 * 10**7)}, {7: 3 * 10**8, 9: 10**9})
    assert wait_shares(before, after) == pytest.approx({0: 0.1, 1: 0.0})


def test_busy_shares():
    before = Reading(0.0, {0: 100, 1: 100}, {0: 200, 1: 200})
    after = Reading(1.0, {0: 105, 1: 200}, {0: 300, 1: 300})
    assert busy_shares(before, after) == {0: 0.05, 1: 1.0}


@pytest.mark.parametrize("current, waits, busy, trial, chosen", [
    ([0, 1], {0: 0.0, 1: 0.5}, {}, set(), [0]),  # queued behind a hog half the time: dropped
    ([0, 1], {0: 0.1, 1: 0.15}, {}, set(), [0, 1]),  # below SHED: kept
    ([0], {0: 0.0}, {1: 0.3}, set(), [0]),  # dropped and still busy: stays out
    ([0], {0: 0.0}, {1: 0.05}, set(), [0, 1]),  # nearly idle: back
    ([0], {0: 0.0}, {1: 0.9}, {1}, [0, 1]),  # busy, but its trial is due
    ([0, 1], {0: 0.6, 1: 0.3}, {}, set(), [1]),  # both delayed: the least delayed one
    ([0], {0: 0.5}, {1: 0.02}, set(), [1]),  # ours is delayed, the other idle: move
])
def test_choose_cpus(current, waits, busy, trial, chosen):
    assert choose_cpus([0, 1], current, waits, busy, trial) == chosen


class FakeProc:
    """A two-CPU machine: our thread 10 pinned to CPU 0, 11 to CPU 1. Each
    second, another process keeps CPU 1 busy at ``hog`` and makes our thread
    there wait that share of the time (CPU 0 stays free)."""

    def __init__(self):
        self.time, self.ticks, self.wait_ns = 0.0, 0, 0
        self.busy = {0: 0, 1: 0}

    def advance(self, seconds: float, hog: float) -> None:
        self.time += seconds
        ticks = round(100 * seconds)
        self.ticks += ticks
        self.busy = {0: self.busy[0], 1: self.busy[1] + round(ticks * hog)}
        self.wait_ns += round(seconds * hog * 1e9)

    def read(self) -> Reading:
        return Reading(self.time, dict(self.busy), {0: self.ticks, 1: self.ticks},
                       {10: (0, 0), 11: (1, self.wait_ns)})


def test_load_watch_drops_and_restores_a_busy_core(caplog):
    proc = FakeProc()
    watch = LoadWatch([0, 1], read=proc.read)
    caplog.set_level(logging.INFO, logger="paged")
    proc.advance(0.5, hog=0.5)
    assert watch.poll([0, 1], proc.time) is None  # not a second yet: nothing read
    proc.advance(0.6, hog=0.5)
    assert watch.poll([0, 1], proc.time) == [0]
    warning = caplog.records[-1]
    assert warning.levelno == logging.WARNING
    assert warning.getMessage().startswith("CPU 1 busy with other processes (our thread waited to run "
                                           "CPU 1 50% of 1.1 s): running 1 thread(s) on CPU 0 (was 2 on CPU 0-1)")
    proc.advance(1.0, hog=1.0)
    assert watch.poll([0], proc.time) is None  # still busy
    proc.advance(1.0, hog=0.0)
    assert watch.poll([0], proc.time) == [0, 1]
    assert caplog.records[-1].levelno == logging.INFO
    assert caplog.records[-1].getMessage().startswith("CPU 1 may be free again")


def test_load_watch_retries_a_busy_core_less_and_less_often(caplog):
    proc = FakeProc()
    watch = LoadWatch([0, 1], read=proc.read)
    caplog.set_level(logging.INFO, logger="paged")
    current, trials = [0, 1], []
    for second in range(1, 200):
        proc.advance(1.0, hog=1.0)
        new = watch.poll(current, proc.time)
        if new is not None:
            if len(new) == 2:
                trials.append(second)
            current = new
    # dropped at 1 s; tried after PROBE_S out, then 2x, 4x, 8x (each failing a second later)
    assert PROBE_S == 10 and trials == [11, 32, 73, 154]
    assert current == [0]
    assert [r.levelno for r in caplog.records].count(logging.WARNING) == 1  # failed trials are INFO


def test_load_watch_ignores_a_window_spanning_idle_time():
    proc = FakeProc()
    watch = LoadWatch([0, 1], read=proc.read)
    proc.advance(60.0, hog=0.9)  # the engine sat idle for a minute
    assert watch.poll([0, 1], proc.time) is None  # only starts a new window
    proc.advance(1.0, hog=0.9)
    assert watch.poll([0, 1], proc.time) == [0]


def test_load_watch_without_proc_never_changes_anything():
    def unreadable():
        raise FileNotFoundError("/proc/stat")

    watch = LoadWatch([0, 1], read=unreadable)
    assert [watch.poll([0, 1], float(t)) for t in (1, 2, 3)] == [None, None, None]


def test_platform_team_follows_the_watch():
    """bind_thread under auto re-pins the team to the CPUs the watch chose."""
    from paged import _C_cpu

    allowed = sorted(_C_cpu.initial_allowed_cpus())
    platform = CpuPlatform()
    platform.init(threads_bind="auto")
    cores = list(platform.plan.cpus)
    if len(cores) < 2:
        pytest.skip("needs two physical cores")
    proc = FakeProc()
    platform._load_watch = LoadWatch(cores, read=lambda: _on(cores, proc.read()))
    try:
        proc.advance(1.0, hog=0.6)
        platform.bind_thread()
        assert platform.plan.cpus == [cores[0]]
        assert [t["affinity"] for t in _C_cpu.thread_report()] == [[cores[0]]]
        proc.advance(1.0, hog=0.0)
        platform.bind_thread()
        assert [t["affinity"] for t in _C_cpu.thread_report()] == [[c] for c in cores]
    finally:
        platform.release_thread()
    assert sorted(os.sched_getaffinity(0)) == allowed


def _on(cores: list[int], r: Reading) -> Reading:
    """FakeProc's CPUs 0 and 1 renamed to the machine's first two cores."""
    rename = {0: cores[0], 1: cores[1]}
    return Reading(r.time, {rename[c]: v for c, v in r.busy.items()}, {rename[c]: v for c, v in r.total.items()},
                   {tid: (rename[c], ns) for tid, (c, ns) in r.waits.items()})
