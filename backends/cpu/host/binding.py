"""``--cpu-threads-bind``: which CPUs a rank's threads are pinned to and
which NUMA node holds its memory, decided from the sysfs topology
(topology.py); the CPU platform applies the plan (platforms/cpu.py init)."""

from __future__ import annotations

from dataclasses import dataclass, field

from paged.backends.cpu.host.cpulist import format_cpulist, parse_cpulist
from paged.backends.cpu.host.topology import Topology


@dataclass
class BindingPlan:
    """What ``--cpu-threads-bind`` resolved to for this process."""

    spec: str
    cpus: list[int] = field(default_factory=list)  # OpenMP thread i -> cpus[i]; empty: no pinning
    node: int | None = None  # NUMA node for memory; None: default policy
    memory_method: str | None = None  # "libnuma" / "set_mempolicy" once applied, or why it failed

    def to_dict(self) -> dict:
        return {"spec": self.spec, "cpus": format_cpulist(self.cpus), "threads": len(self.cpus),
                "node": self.node, "memory_method": self.memory_method}


def plan_binding(spec: str, topology: Topology, rank: int = 0, world_size: int = 1) -> BindingPlan:
    """Resolve ``auto | none | <cpulist>[|<cpulist>...]`` (one list per rank).

    auto: one thread per physical core of the node with the most usable
    cores; under tensor parallelism (``world_size`` ranks) rank r takes node
    r when there are as many nodes with cores as ranks, else a contiguous
    share of the best node's cores. A CPU list: exactly those CPUs, memory
    on the node holding most.
    """
    spec = (spec or "").strip()
    if spec == "none":
        return BindingPlan(spec)
    if spec == "auto":
        return _auto_plan(topology, rank, world_size)
    lists = spec.split("|")
    if rank >= len(lists):
        raise ValueError(f"--cpu-threads-bind {spec!r} has {len(lists)} CPU list(s), none for rank {rank}")
    try:
        cpus = parse_cpulist(lists[rank], allowed=topology.usable)
    except ValueError as e:
        raise ValueError(f"--cpu-threads-bind: {e} (use auto, none or a CPU list like 0-3)") from None
    return BindingPlan(spec, cpus, topology.node_of(cpus))


def _auto_plan(topology: Topology, rank: int, world_size: int) -> BindingPlan:
    nodes = [n for n in topology.nodes if n.cores]
    if world_size > 1 and len(nodes) >= world_size:
        node = nodes[rank]
        return BindingPlan("auto", topology.one_thread_per_core(node), node.id)
    node = topology.best_node()
    cores = topology.one_thread_per_core(node)
    if world_size > len(cores):
        raise ValueError(f"--tensor-parallel-size {world_size}: expected at most the {len(cores)} physical "
                         f"core(s) of NUMA node {node.id} for --cpu-threads-bind auto, got more ranks")
    share = len(cores) // world_size
    return BindingPlan("auto", cores[rank * share:(rank + 1) * share], node.id)
