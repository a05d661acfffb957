"""CPU / NUMA topology read from sysfs, limited to the CPUs this process may use.

Sources (under ``sysfs_root``, "/sys" by default, so tests can point at a
synthetic tree): devices/system/cpu/online, devices/system/cpu/cpuN/topology/
{thread_siblings_list,core_id,physical_package_id}, devices/system/node/nodeN/
{cpulist,meminfo}. Without NUMA information the machine is one node; without
sysfs at all (macOS) every CPU the OS counts is online, one node, one core
each, and on Apple Silicon `sysctl hw.perflevel*` tells performance from
efficiency cores (efficiency_cpus, which `auto` leaves out). macOS numbers no
CPU for us and pins nothing, so there the ids are labels: the first
hw.perflevel0.logicalcpu ones stand for the performance cores.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from paged.backends.cpu.host.cpulist import format_cpulist, parse_cpulist


@dataclass(frozen=True)
class NumaNode:
    id: int
    cpus: tuple[int, ...]  # usable CPUs (online and allowed) on this node
    cores: tuple[tuple[int, ...], ...]  # usable CPUs grouped by physical core (SMT siblings together)
    mem_total_bytes: int | None  # None when sysfs has no meminfo for the node
    mem_free_bytes: int | None

    def to_dict(self) -> dict:
        return {
            "id": self.id,
            "cpus": format_cpulist(self.cpus),
            "physical_cores": len(self.cores),
            "smt_siblings": [format_cpulist(core) for core in self.cores if len(core) > 1],
            "mem_total_bytes": self.mem_total_bytes,
            "mem_free_bytes": self.mem_free_bytes,
        }


@dataclass(frozen=True)
class Topology:
    nodes: tuple[NumaNode, ...]  # every node with usable CPUs or memory
    online: tuple[int, ...]  # online CPUs of the machine
    allowed: tuple[int, ...]  # CPUs this process may use (its affinity mask)
    numa_info: bool = True  # False: sysfs had no node directory, one node assumed
    cpu_node: dict[int, int] = field(default_factory=dict)  # usable CPU -> its node
    efficiency_cpus: tuple[int, ...] = ()  # Apple Silicon efficiency cores (auto leaves them out)

    @property
    def usable(self) -> tuple[int, ...]:
        """CPUs that are online and allowed."""
        return tuple(sorted(set(self.online) & set(self.allowed)))

    def node(self, node_id: int) -> NumaNode:
        for node in self.nodes:
            if node.id == node_id:
                return node
        raise ValueError(f"NUMA node {node_id} does not exist (nodes: {', '.join(str(n.id) for n in self.nodes)})")

    def best_node(self) -> NumaNode:
        """The node with the most usable physical cores (lowest id on ties)."""
        candidates = [n for n in self.nodes if n.cores]
        if not candidates:
            raise ValueError("no usable CPU: none of the allowed CPUs is online")
        return max(candidates, key=lambda n: (len(n.cores), -n.id))

    def one_thread_per_core(self, node: NumaNode) -> list[int]:
        """The first usable SMT sibling of each physical core of ``node``
        (efficiency cores left out where there are performance cores)."""
        firsts = sorted(core[0] for core in node.cores)
        performance = [c for c in firsts if c not in self.efficiency_cpus]
        return performance or firsts

    def node_of(self, cpus: list[int]) -> int:
        """The node holding most of ``cpus`` (lowest id on ties)."""
        counts: dict[int, int] = {}
        for cpu in cpus:
            node = self.cpu_node.get(cpu)
            if node is not None:
                counts[node] = counts.get(node, 0) + 1
        if not counts:
            raise ValueError(f"CPU {format_cpulist(cpus)} belongs to no NUMA node")
        return max(counts, key=lambda n: (counts[n], -n))

    def to_dict(self) -> dict:
        return {
            "numa_info": self.numa_info,
            "online_cpus": format_cpulist(self.online),
            "allowed_cpus": format_cpulist(self.allowed),
            "usable_cpus": format_cpulist(self.usable),
            "physical_cores": sum(len(n.cores) for n in self.nodes),
            "nodes": [n.to_dict() for n in self.nodes],
            **({"efficiency_cpus": format_cpulist(self.efficiency_cpus)} if self.efficiency_cpus else {}),
        }


def process_cpus() -> set[int]:
    """CPUs this process may use: its affinity mask where the OS has one
    (Linux), else every CPU (macOS has no affinity API)."""
    if hasattr(os, "sched_getaffinity"):
        return os.sched_getaffinity(0)
    return set(range(os.cpu_count() or 1))


def can_pin_threads() -> bool:
    """Whether the OS lets a thread be pinned to CPUs (Linux yes, macOS no)."""
    return hasattr(os, "sched_setaffinity")


def set_thread_cpus(tid: int, cpus: set[int] | list[int]) -> bool:
    """Pin thread ``tid`` (0: the caller) to ``cpus``; False where the OS
    cannot pin (macOS)."""
    if not can_pin_threads():
        return False
    os.sched_setaffinity(tid, cpus)
    return True


def macos_sysctl(name: str) -> int | None:
    """An integer sysctl value on macOS (None elsewhere or when absent)."""
    if sys.platform != "darwin":
        return None
    try:
        out = subprocess.run(["sysctl", "-n", name], capture_output=True, text=True, timeout=5)
        return int(out.stdout.strip()) if out.returncode == 0 else None
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return None


def _efficiency_cpus(online: list[int], sysctl: Callable[[str], int | None]) -> tuple[int, ...]:
    """Apple Silicon: CPUs past hw.perflevel0's (the performance cores) when
    a second perf level exists; () elsewhere."""
    performance, efficiency = sysctl("hw.perflevel0.logicalcpu"), sysctl("hw.perflevel1.logicalcpu")
    if not performance or not efficiency:
        return ()
    return tuple(c for c in online if c >= performance)


def read_topology(sysfs_root: str | os.PathLike = "/sys", allowed: set[int] | list[int] | None = None,
                  sysctl: Callable[[str], int | None] = macos_sysctl) -> Topology:
    """Read the topology; ``allowed`` defaults to process_cpus(); ``sysctl``
    answers the macOS queries where there is no sysfs (tests pass their own)."""
    system = Path(sysfs_root) / "devices" / "system"
    cpu_dir, node_dir = system / "cpu", system / "node"
    allowed_set = set(process_cpus() if allowed is None else allowed)
    online = _online_cpus(cpu_dir)
    usable = sorted(set(online) & allowed_set)

    node_cpus = _node_cpulists(node_dir)
    numa_info = bool(node_cpus)
    if not numa_info:
        node_cpus = {0: list(online)}

    core_of = {cpu: _core_key(cpu_dir / f"cpu{cpu}" / "topology", cpu) for cpu in usable}
    nodes, cpu_node = [], {}
    for node_id in sorted(node_cpus):
        cpus = [c for c in node_cpus[node_id] if c in core_of]
        groups: dict[tuple, list[int]] = {}
        for cpu in cpus:
            groups.setdefault(core_of[cpu], []).append(cpu)
            cpu_node[cpu] = node_id
        total, free = _node_memory(node_dir / f"node{node_id}" / "meminfo") if numa_info else (None, None)
        if not cpus and total is None:
            continue  # nothing usable on this node
        cores = tuple(sorted(tuple(sorted(g)) for g in groups.values()))
        nodes.append(NumaNode(node_id, tuple(cpus), cores, total, free))
    efficiency = () if cpu_dir.is_dir() else _efficiency_cpus(online, sysctl)
    return Topology(tuple(nodes), tuple(online), tuple(sorted(allowed_set)), numa_info, cpu_node, efficiency)


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _online_cpus(cpu_dir: Path) -> list[int]:
    if not cpu_dir.is_dir():  # no sysfs (macOS): what the OS counts
        return list(range(os.cpu_count() or 1))
    text = _read(cpu_dir / "online")
    if text is not None:
        return parse_cpulist(text, allow_empty=True)
    # Old kernels / minimal trees: every cpuN directory counts as online.
    return sorted(int(m.group(1)) for p in cpu_dir.glob("cpu*") if (m := re.fullmatch(r"cpu(\d+)", p.name)))


def _node_cpulists(node_dir: Path) -> dict[int, list[int]]:
    nodes = {}
    for path in node_dir.glob("node*"):
        match = re.fullmatch(r"node(\d+)", path.name)
        if match:
            nodes[int(match.group(1))] = parse_cpulist(_read(path / "cpulist") or "", allow_empty=True)
    return nodes


def _core_key(topo_dir: Path, cpu: int) -> tuple:
    """Identifies the physical core of ``cpu``: its SMT sibling set when sysfs
    lists it, else (package, core_id), else the CPU itself."""
    siblings = _read(topo_dir / "thread_siblings_list") or _read(topo_dir / "core_cpus_list")
    if siblings:
        return ("siblings", tuple(parse_cpulist(siblings)))
    core_id, package = _read(topo_dir / "core_id"), _read(topo_dir / "physical_package_id")
    if core_id is not None and package is not None:
        return ("core", int(package), int(core_id))
    return ("cpu", cpu)


def _node_memory(meminfo: Path) -> tuple[int | None, int | None]:
    text = _read(meminfo)
    if text is None:
        return None, None
    values = {}
    for line in text.splitlines():  # "Node 0 MemTotal:  5859540 kB"
        match = re.match(r"Node\s+\d+\s+(\w+):\s+(\d+)\s*kB", line)
        if match:
            values[match.group(1)] = int(match.group(2)) * 1024
    return values.get("MemTotal"), values.get("MemFree")


def system_memory(proc_root: str | os.PathLike = "/proc") -> tuple[int, int]:
    """(MemTotal, MemAvailable) of the machine from /proc/meminfo, in bytes."""
    values = {}
    for line in (Path(proc_root) / "meminfo").read_text().splitlines():
        match = re.match(r"(\w+):\s+(\d+)\s*kB", line)
        if match:
            values[match.group(1)] = int(match.group(2)) * 1024
    return values["MemTotal"], values.get("MemAvailable", values.get("MemFree", 0))
