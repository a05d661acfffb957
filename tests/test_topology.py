"""Topology from sysfs, CPU lists and sizes.

Synthetic sysfs trees are the oracle for the edge cases (2 nodes, SMT,
offline CPUs, a cpuset-restricted process); the real machine is checked
against lscpu and os.sched_getaffinity.
"""

import os
import shutil
import subprocess

import pytest
from hypothesis import given, strategies as st

from paged.backends.cpu.host.binding import plan_binding
from paged.platforms.cpu import CpuPlatform
from paged.backends.cpu.host.cpulist import format_cpulist, parse_cpulist
from paged.platforms.sizes import parse_size
from paged.backends.cpu.host.topology import read_topology


def make_sysfs(root, nodes, siblings, online, mem_kb=None):
    """nodes: node -> cpulist; siblings: list of SMT sibling groups."""
    system = root / "devices" / "system"
    cpu_dir = system / "cpu"
    cpu_dir.mkdir(parents=True)
    (cpu_dir / "online").write_text(online + "\n")
    for package, group in enumerate(siblings):
        for cpu in group:
            topo = cpu_dir / f"cpu{cpu}" / "topology"
            topo.mkdir(parents=True)
            (topo / "thread_siblings_list").write_text(format_cpulist(group) + "\n")
            (topo / "core_id").write_text(f"{min(group)}\n")
            (topo / "physical_package_id").write_text("0\n")
    for node, cpus in (nodes or {}).items():
        nd = system / "node" / f"node{node}"
        nd.mkdir(parents=True)
        (nd / "cpulist").write_text(cpus + "\n")
        total, free = (mem_kb or {}).get(node, (1024, 512))
        (nd / "meminfo").write_text(f"Node {node} MemTotal:  {total} kB\nNode {node} MemFree:   {free} kB\n"
                                    f"Node {node} MemUsed:   {total - free} kB\n")
    return root


# Two nodes of two SMT cores each: node 0 = cores {0,4} {1,5}, node 1 = {2,6} {3,7}.
TWO_NODES = {0: "0-1,4-5", 1: "2-3,6-7"}
SMT_PAIRS = [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_two_nodes_with_smt(tmp_path):
    make_sysfs(tmp_path, TWO_NODES, SMT_PAIRS, "0-7", mem_kb={0: (8 << 20, 6 << 20), 1: (4 << 20, 1 << 20)})
    topo = read_topology(tmp_path, allowed=range(8))
    assert [n.id for n in topo.nodes] == [0, 1]
    assert topo.nodes[0].cpus == (0, 1, 4, 5)
    assert topo.nodes[0].cores == ((0, 4), (1, 5))
    assert topo.nodes[1].cores == ((2, 6), (3, 7))
    assert topo.nodes[0].mem_total_bytes == (8 << 20) * 1024
    assert topo.nodes[1].mem_free_bytes == (1 << 20) * 1024
    plan = plan_binding("auto", topo)
    assert (plan.node, plan.cpus) == (0, [0, 1])  # one thread per core, tie -> lowest node
    assert topo.to_dict()["nodes"][0]["smt_siblings"] == ["0,4", "1,5"]


def test_offline_cpus_and_cpuset_restriction(tmp_path):
    make_sysfs(tmp_path, TWO_NODES, SMT_PAIRS, "0-6")  # cpu 7 offline
    topo = read_topology(tmp_path, allowed={1, 2, 3, 5, 6, 7})  # cpuset: cpu 0 and 4 not ours
    assert topo.usable == (1, 2, 3, 5, 6)
    assert topo.nodes[0].cores == ((1, 5),)
    assert topo.nodes[1].cores == ((2, 6), (3,))  # 3's sibling 7 is offline
    plan = plan_binding("auto", topo)
    assert (plan.node, plan.cpus) == (1, [2, 3])  # node 1 has more usable cores
    explicit = plan_binding("5,6,2", topo)
    assert (explicit.cpus, explicit.node) == ([2, 5, 6], 1)
    with pytest.raises(ValueError, match=r"CPU 0,7 in CPU list '0-1,7' is not allowed for this process"):
        plan_binding("0-1,7", topo)
    assert plan_binding("none", topo).cpus == []


def test_one_node_without_numa_info(tmp_path):
    make_sysfs(tmp_path, None, [[0, 1], [2, 3]], "0-3")
    topo = read_topology(tmp_path, allowed=range(4))
    assert not topo.numa_info
    assert len(topo.nodes) == 1 and topo.nodes[0].cpus == (0, 1, 2, 3)
    assert topo.nodes[0].mem_total_bytes is None
    assert plan_binding("auto", topo).cpus == [0, 2]


def test_per_rank_cpu_lists(tmp_path):
    make_sysfs(tmp_path, TWO_NODES, SMT_PAIRS, "0-7")
    topo = read_topology(tmp_path, allowed=range(8))
    assert plan_binding("0-1|2-3", topo, rank=1).cpus == [2, 3]
    with pytest.raises(ValueError, match="none for rank 2"):
        plan_binding("0-1|2-3", topo, rank=2)


def test_platform_memory_from_bound_node(tmp_path):
    make_sysfs(tmp_path, TWO_NODES, SMT_PAIRS, "0-7", mem_kb={0: (1000, 100), 1: (4000, 3000)})
    platform = CpuPlatform(sysfs_root=tmp_path, allowed={2, 3})
    from paged.backends.cpu.host.binding import BindingPlan

    platform.plan = BindingPlan("2-3", [2, 3], 1)  # what init() would record, without pinning this process
    mem = platform.memory_info()
    assert (mem.total_bytes, mem.available_bytes) == (4000 * 1024, 3000 * 1024)
    assert platform.kv_cache_budget_bytes() == int(3000 * 1024 * platform.default_kv_cache_fraction)
    assert platform.kv_cache_budget_bytes(2**20) == 2**20
    with pytest.raises(ValueError, match=r"--kv-cache-memory: expected at most the 2\.93 MiB available on cpu, "
                                         r"got 4\.00 MiB"):
        platform.kv_cache_budget_bytes(4 * 2**20)


def test_platform_memory_on_one_node_is_the_machines(tmp_path):
    # one node: its sysfs meminfo (here far below the machine's, as in a VM
    # whose node0 leaves out hot-plugged memory) gives way to /proc/meminfo
    make_sysfs(tmp_path, {0: "0-3"}, [[0], [1], [2], [3]], "0-3", mem_kb={0: (1000, 100)})
    platform = CpuPlatform(sysfs_root=tmp_path, allowed={0, 1, 2, 3})
    from paged.backends.cpu.host.binding import BindingPlan
    from paged.backends.cpu.host.topology import system_memory

    platform.plan = BindingPlan("0-3", [0, 1, 2, 3], 0)
    before = system_memory()
    mem = platform.memory_info()
    after = system_memory()
    assert mem.total_bytes == before[0] == after[0] and mem.total_bytes > 1000 * 1024
    assert min(before[1], after[1]) - (64 << 20) <= mem.available_bytes <= max(before[1], after[1]) + (64 << 20)


def test_real_machine_matches_lscpu_and_affinity():
    topo = read_topology()
    usable = set(topo.usable)
    assert usable == set(os.sched_getaffinity(0)) & set(topo.online)
    assert set().union(*(n.cpus for n in topo.nodes)) == usable
    if shutil.which("lscpu") is None:
        pytest.skip("lscpu not installed: no independent view of cores")
    rows = [line.split(",") for line in subprocess.run(
        ["lscpu", "-p=CPU,CORE,SOCKET,NODE"], capture_output=True, text=True, check=True).stdout.splitlines()
        if not line.startswith("#")]
    cores = {(r[2], r[1]) for r in rows if int(r[0]) in usable}
    assert sum(len(n.cores) for n in topo.nodes) == len(cores)
    for r in rows:
        if int(r[0]) in usable and r[3]:
            assert topo.cpu_node[int(r[0])] == int(r[3])


@pytest.mark.parametrize("text, message", [
    ("5-2", "is reversed"), ("a", "'a' in CPU list 'a' is not a CPU number"), ("", "empty"),
    ("1,,2", "has an empty entry"), ("-1", "not a CPU number"), ("1-", "not a CPU number"),
    ("0-3,2", "names CPU 2 more than once"), ("0x1", "not a CPU number"),
])
def test_malformed_cpulists(text, message):
    with pytest.raises(ValueError, match=message):
        parse_cpulist(text)


def test_cpulist_not_allowed():
    with pytest.raises(ValueError, match=r"CPU 8,10 .* not allowed for this process \(allowed: 0-7\)"):
        parse_cpulist("0-3,8,10", allowed=range(8))


def test_huge_ranges_refused_before_expanding():
    # these were expanded first: MemoryError here, ~4 GB for 0-99999999
    with pytest.raises(ValueError, match=r"^CPU 2,8-99999999999999 in CPU list '0-99999999999999' is not allowed "
                                         r"for this process \(allowed: 0-1,3-7\)$"):
        parse_cpulist("0-99999999999999", allowed={0, 1, 3, 4, 5, 6, 7})
    with pytest.raises(ValueError, match=r"expected CPU numbers up to 8191 .*, got 9000-99999999999999$"):
        parse_cpulist("0-3,9000-99999999999999")
    assert parse_cpulist("8190-8191") == [8190, 8191]


@given(st.sets(st.integers(0, 300), min_size=1, max_size=40))
def test_cpulist_round_trip(cpus):
    assert parse_cpulist(format_cpulist(cpus)) == sorted(cpus)


@pytest.mark.parametrize("text, expected", [
    ("2GiB", 2 * 2**30), ("512MiB", 512 * 2**20), ("1.5G", int(1.5 * 2**30)), ("1000000", 10**6),
    ("3gb", 3 * 10**9), ("64k", 64 * 1024), ("10 B", 10),
])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "1.5Q", "-1G", "1..2", "two"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError, match=repr(text).replace(".", r"\.")):
        parse_size(text)


def test_no_sysfs_counts_the_os_cpus_and_leaves_out_efficiency_cores(tmp_path):
    """macOS has no /sys: every CPU the OS counts is online, one node, and an
    Apple Silicon machine's efficiency cores (hw.perflevel1) stay out of
    auto's threads. The sysctl answers here are given by the test (this runs
    the glue, not macOS: docs/cpu.md)."""
    n = os.cpu_count()
    apple = {"hw.perflevel0.logicalcpu": max(1, n - 1), "hw.perflevel1.logicalcpu": 1}
    topo = read_topology(tmp_path, allowed=set(range(n)), sysctl=apple.get)
    assert topo.online == tuple(range(n)) and len(topo.nodes) == 1 and not topo.numa_info
    plan = plan_binding("auto", topo)
    if n > 1:
        assert topo.efficiency_cpus == (n - 1,) and plan.cpus == list(range(n - 1))
        assert topo.to_dict()["efficiency_cpus"] == str(n - 1)
    plain = read_topology(tmp_path, allowed=set(range(n)), sysctl=lambda name: None)
    assert plain.efficiency_cpus == () and plan_binding("auto", plain).cpus == list(range(n))


def test_env_says_threads_are_not_pinned_where_the_os_cannot(monkeypatch):
    """Where the OS has no affinity API (macOS; simulated here by making
    can_pin_threads answer False) `paged env` says nothing is pinned."""
    import paged.platforms.cpu as cpu_mod
    from paged.core.entrypoints.cli import env_report, format_env

    assert "pinning" not in CpuPlatform().env_report()  # Linux pins
    monkeypatch.setattr(cpu_mod, "can_pin_threads", lambda: False)
    report = env_report(CpuPlatform(), "none")
    assert report["pinning"].startswith("none: this OS has no CPU affinity API")
    assert "pinning         none: this OS has no CPU affinity API" in format_env(report)
