"""The C++ CPU runtime: pinning verified from inside the OpenMP threads,
memory policy read back through an independent get_mempolicy call, CPU
features against /proc/cpuinfo."""

import ctypes
import os

import pytest

_C_cpu = pytest.importorskip("paged._C_cpu")

from paged.platforms.cpu import CpuPlatform  # noqa: E402

ALLOWED = sorted(_C_cpu.initial_allowed_cpus())
SYS_GET_MEMPOLICY = 239  # x86_64
MPOL_NAMES = {0: "default", 1: "preferred", 2: "bind"}


@pytest.fixture(autouse=True)
def restore_runtime():
    yield
    _C_cpu.unbind_threads()
    _C_cpu.reset_memory_policy()
    import torch

    torch.set_num_threads(len(ALLOWED))


def test_initial_mask_is_captured_at_import():
    import subprocess
    import sys

    code = ("import os; os.sched_setaffinity(0, {%d}); import paged._C_cpu as m; "
            "m.bind_threads([%d]); print(m.initial_allowed_cpus())" % (ALLOWED[-1], ALLOWED[-1]))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == f"[{ALLOWED[-1]}]"


@pytest.mark.parametrize("count", [1, 2])
def test_bind_threads_pins_each_thread(count):
    if len(ALLOWED) < count:
        pytest.skip(f"needs {count} allowed CPUs, this process has {len(ALLOWED)}")
    cpus = ALLOWED[:count][::-1]  # reversed: thread 0 gets the higher CPU
    _C_cpu.bind_threads(cpus)
    report = _C_cpu.thread_report()
    assert [t["thread"] for t in report] == list(range(count))
    for t in report:
        assert t["affinity"] == [cpus[t["thread"]]]
        assert t["cpu"] == cpus[t["thread"]]
    assert os.sched_getaffinity(0) == {cpus[0]}  # the caller is OpenMP thread 0


def test_torch_runs_on_the_pinned_pool():
    import torch

    cpus = ALLOWED[:2]
    torch.set_num_threads(len(cpus))
    _C_cpu.bind_threads(cpus)
    torch.randn(512, 512) @ torch.randn(512, 512)  # torch's parallel region in between
    assert [t["affinity"] for t in _C_cpu.thread_report()] == [[c] for c in cpus]


def test_unbind_restores_the_initial_mask():
    _C_cpu.bind_threads(ALLOWED[:1])
    _C_cpu.unbind_threads()
    report = _C_cpu.thread_report()
    assert len(report) >= 1 and all(t["affinity"] == ALLOWED for t in report)
    assert os.sched_getaffinity(0) == set(ALLOWED)


@pytest.mark.parametrize("cpus, message", [
    ([], r"^cpus \(bind_threads\): expected a non-empty CPU list, got an empty one$"),
    ([-1], r"^cpus \(bind_threads\): expected CPUs in \[0, \d+\), got CPU -1$"),
    ([4096], r"^cpus \(bind_threads\): expected CPUs in \[0, \d+\), got CPU 4096$"),
    ([ALLOWED[0], ALLOWED[0]], rf"^cpus \(bind_threads\): expected distinct CPUs, got CPU {ALLOWED[0]} listed twice$"),
    ([max(ALLOWED) + 1],
     rf"^cpus \(bind_threads\): expected CPUs allowed for this process, got CPU {max(ALLOWED) + 1} \(not allowed\)$"),
])
def test_bind_threads_rejects_bad_cpus(cpus, message):
    before = _C_cpu.thread_report()
    with pytest.raises(ValueError, match=message):
        _C_cpu.bind_threads(cpus)
    assert _C_cpu.thread_report() == before  # nothing changed


def _get_mempolicy():
    """The calling thread's policy via libc, independent of the C++ runtime."""
    libc = ctypes.CDLL(None, use_errno=True)
    mode = ctypes.c_int()
    mask = (ctypes.c_ulong * 16)()
    if libc.syscall(SYS_GET_MEMPOLICY, ctypes.byref(mode), mask, ctypes.c_ulong(1024), None, ctypes.c_ulong(0)):
        pytest.skip(f"get_mempolicy not permitted here: {os.strerror(ctypes.get_errno())}")
    nodes = [n for n in range(1024) if mask[n // 64] >> (n % 64) & 1]
    return MPOL_NAMES.get(mode.value & 0xFF, str(mode.value)), nodes


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="syscall number is for x86_64")
@pytest.mark.parametrize("method, strict", [("auto", False), ("syscall", False), ("syscall", True),
                                            ("libnuma", False), ("libnuma", True)])
def test_bind_memory_to_node(method, strict):
    if method == "libnuma" and not _C_cpu.libnuma_available():
        pytest.skip("libnuma.so.1 not installed")
    node = CpuPlatform().topology().best_node().id
    used = _C_cpu.bind_memory_to_node(node, strict=strict, method=method)
    assert used == ("set_mempolicy" if method == "syscall" or not _C_cpu.libnuma_available() else "libnuma")
    expected = ("bind" if strict else "preferred", [node])
    assert _get_mempolicy() == expected
    assert (_C_cpu.memory_policy()["mode"], _C_cpu.memory_policy()["nodes"]) == expected
    _C_cpu.reset_memory_policy()
    assert _get_mempolicy() == ("default", [])


@pytest.mark.parametrize("node, method", [(-1, "auto"), (1024, "syscall"), (1023, "syscall"), (1023, "auto")])
def test_bind_memory_rejects_bad_nodes(node, method):
    with pytest.raises(ValueError, match=rf"^node \(bind_memory_to_node\): expected .*, got {node}$"):
        _C_cpu.bind_memory_to_node(node, method=method)


def test_bind_memory_rejects_unknown_method():
    with pytest.raises(ValueError, match=r"^method \(bind_memory_to_node\): expected one of auto, libnuma, syscall, got 'numactl'$"):
        _C_cpu.bind_memory_to_node(0, method="numactl")


def test_platform_init_binds_and_reports():
    import torch

    platform = CpuPlatform()
    platform.init(threads_bind="auto")
    topo = platform.topology()
    node = topo.best_node()
    assert platform.plan.cpus == topo.one_thread_per_core(node)
    assert torch.get_num_threads() == len(platform.plan.cpus)
    report = platform.env_report()
    assert [t["affinity"] for t in report["threads"]] == [[c] for c in platform.plan.cpus]
    assert report["binding"]["node"] == node.id
    assert report["memory_policy"]["nodes"] == [node.id] or report["binding"]["memory_method"].startswith("not bound")
    dtypes = platform.supported_dtypes()
    assert dtypes[:2] == [torch.float32, torch.bfloat16]  # auto = float32 on every generation
    assert platform.default_dtype() == torch.float32
    assert report["kernel_builds"] == {"attention": _C_cpu.attention_isa(), "linear": _C_cpu.linear_isa(),
                                       "fused_ops": _C_cpu.fused_ops_isa()}
    assert 0 < report["kv_cache_budget_bytes"] <= report["memory"]["available_bytes"]


def test_platform_init_none_leaves_threads_alone():
    before = _C_cpu.thread_report()
    platform = CpuPlatform()
    platform.init(threads_bind="none")
    assert platform.plan.cpus == [] and platform.plan.node is None
    assert _C_cpu.thread_report() == before
    assert platform.env_report()["threads"] is None


def test_bind_thread_pins_the_team_of_a_later_thread():
    """The server steps the engine from its own thread: that thread's OpenMP
    team must be pinned too (a fresh team inherits its creator's one-CPU
    mask), and the thread bound before is released to every allowed CPU."""
    import threading

    if len(ALLOWED) < 2:
        pytest.skip("needs 2 allowed CPUs to tell pinned teams apart")
    platform = CpuPlatform()
    platform.init(threads_bind=",".join(map(str, ALLOWED[:2])))
    seen = {}

    def engine_thread():
        seen["before"] = _C_cpu.thread_report()
        platform.bind_thread()
        seen["after"] = _C_cpu.thread_report()
        platform.bind_thread()  # idempotent for the same thread
        seen["again"] = _C_cpu.thread_report()

    t = threading.Thread(target=engine_thread)
    t.start()
    t.join()
    want = [[c] for c in ALLOWED[:2]]
    assert [r["affinity"] for r in seen["before"]] != want  # the inherited mask: the bug this fixes
    assert [r["affinity"] for r in seen["after"]] == want
    assert [r["cpu"] for r in seen["after"]] == ALLOWED[:2]
    assert seen["again"] == seen["after"]
    assert sorted(os.sched_getaffinity(0)) == ALLOWED  # this (previously bound) thread released


def test_release_thread_hands_the_pool_over():
    """release_thread frees this thread's OpenMP pool and pin (so the
    engine thread's team is the only one); a later region here still works."""
    if len(ALLOWED) < 2:
        pytest.skip("needs 2 allowed CPUs")
    platform = CpuPlatform()
    platform.init(threads_bind=",".join(map(str, ALLOWED[:2])))
    assert sorted(os.sched_getaffinity(0)) == [ALLOWED[0]]
    platform.release_thread()
    assert sorted(os.sched_getaffinity(0)) == ALLOWED
    platform.release_thread()  # not bound any more: a no-op
    assert len(_C_cpu.thread_report()) == 2  # a new pool on demand
