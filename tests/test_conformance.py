"""The conformance suite as a product: runner behaviour, that its checks can
fail, and full CLI runs for cpu and for the example third-party plugin."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import entry_point_site
import pytest
import torch

from paged.backends.reference.attention import ReferenceBackend
from paged.core.engine.block_pool_spec import BlockPoolModel
from paged.core.engine.worker import Worker
from paged.core.conformance import e2e_checks, kernel_checks, pool_checks
from paged.core.conformance.runner import FAIL, PASS, SKIP, Check, Context, Measured, Report, Skip, run_check
from paged.platforms.base import Availability, MemoryInfo, Platform
from paged.platforms.capabilities import Capabilities

PLUGIN_DIR = Path(__file__).parent / "plugin_example"
PAGED = Path(sys.executable).with_name("paged")


# ---- the runner ------------------------------------------------------------

def test_runner_turns_errors_and_skips_into_results():
    ctx = Context(platform=None)

    def boom(_):
        raise ZeroDivisionError("division by zero in the kernel")

    def skip(_):
        raise Skip("needs an NPU")

    results = [run_check(Check("a", lambda _: 0.5), ctx), run_check(Check("b", boom), ctx),
               run_check(Check("c", skip), ctx)]
    assert [r.status for r in results] == [PASS, FAIL, SKIP]
    assert results[0].max_error == 0.5
    assert "ZeroDivisionError: division by zero in the kernel" in results[1].detail
    assert results[2].detail == "needs an NPU"
    report = Report("x", True, results)
    assert not report.passed and "DOES NOT CONFORM" in report.table()
    assert Report("x", True, [results[0], results[2]]).passed
    assert not Report("x", True, [results[2]]).passed  # nothing ran: not a pass


# ---- the checks catch broken implementations --------------------------------

class _Worker(Worker):
    def attention_backend_cls(self):
        return self.platform.backend_cls


class _Platform(Platform):
    """A minimal in-test platform whose pieces a test can swap for broken ones."""
    name, device_type, default_block_size = "test", "cpu", 16
    backend_cls, caps = ReferenceBackend, None

    def capabilities(self):
        return self.caps or super().capabilities()

    def is_available(self):
        return Availability(True)

    def device_count(self):
        return 1

    def memory_info(self):
        return MemoryInfo(2**30, 2**29)

    def supported_dtypes(self):
        return [torch.float32]

    def worker_cls(self):
        return _Worker


class _LifoFreePool(BlockPoolModel):
    """Frees cached blocks to the head of the queue: breaks LRU eviction."""

    def free(self, ids):
        super().free(ids)
        for b in ids:
            if b in self._free:
                self._free.move_to_end(b, last=False)


class _BatchDependentBackend(ReferenceBackend):
    """Correct alone, slightly different in a batch: not batch invariant."""

    def paged_attention(self, out, query, *args, **kw):
        super().paged_attention(out, query, *args, **kw)
        if query.shape[0] > 1:
            out.add_(1e-3)


def test_pool_check_passes_the_model_and_catches_a_broken_pool():
    p = _Platform()
    assert run_check(Check("pool", pool_checks._random_sequence), Context(p, quick=True)).status == PASS
    assert run_check(Check("pool", pool_checks._random_sequence),
                     Context(p, quick=True, cache={"pool_cls": BlockPoolModel})).status == PASS
    r = run_check(Check("pool", pool_checks._random_sequence), Context(p, quick=True, cache={"pool_cls": _LifoFreePool}))
    assert r.status == FAIL and "free_queue differs from the model" in r.detail


def test_batch_invariance_check_catches_a_batch_dependent_backend():
    p = _Platform()
    ok = run_check(Check("bi", e2e_checks._batch_invariance), Context(p, quick=True))
    assert ok.status == PASS and ok.max_error == 0.0
    p.backend_cls = _BatchDependentBackend
    bad = run_check(Check("bi", e2e_checks._batch_invariance), Context(p, quick=True))
    assert bad.status == FAIL and "batch composition" in bad.detail


class _Only128Backend(ReferenceBackend):
    """Refuses block sizes that are not multiples of 128, as the NPU operators do."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        if self.block_size % 128:
            raise ValueError(f"block_size: expected a multiple of 128, got {self.block_size}")


def test_undeclared_invariance_is_measured_declared_is_asserted():
    p = _Platform()
    p.backend_cls = _BatchDependentBackend
    p.caps = Capabilities(dtypes=(torch.float32,), batch_invariant={"float32": ("prefill", "engine")})
    r = run_check(Check("bi", e2e_checks._batch_invariance), Context(p, quick=True))
    assert r.status == PASS and r.max_error == pytest.approx(1e-3, rel=0.05), r
    assert "not declared batch invariant" in r.detail and "decode" in r.detail
    p.caps = Capabilities(dtypes=(torch.float32,), batch_invariant={"float32": ("decode",)})
    r = run_check(Check("bi", e2e_checks._batch_invariance), Context(p, quick=True))
    assert r.status == FAIL and "decode outputs change with the batch composition" in r.detail


def test_kernel_cases_are_built_from_the_declaration():
    """A 128-only backend fails the fixed 16/32-token cases unless the
    platform declares 128-token blocks; declared, every check runs on them."""
    only128 = Capabilities(dtypes=(torch.float32,), block_size_multiple=128, batch_invariant={})
    assert all(c.block_size % 128 == 0 for c in kernel_checks.edge_cases(0, only128))
    with pytest.raises(ValueError, match="multiple of 128"):
        kernel_checks.check_cache_roundtrip(_Only128Backend, "cpu", torch.float32)
    for check in (kernel_checks.check_cache_roundtrip, kernel_checks.check_copy_and_swap,
                  kernel_checks.check_argument_errors):
        assert check(_Only128Backend, "cpu", torch.float32, caps=only128) == 0.0
    assert kernel_checks.check_edge_cases(_Only128Backend, "cpu", torch.float32, quick=True, caps=only128) < 1e-5
    got = kernel_checks.check_batch_invariance(_Only128Backend, "cpu", torch.float32, caps=only128)
    # measured, not asserted (nothing declared): the torch reference is invariant across batches, order and
    # threads, but a prompt's rows computed in chunks differ in the last bits (other matmul shapes)
    assert isinstance(got, Measured) and 0.0 <= got.value < 1e-5


def test_declaration_checks_name_the_value():
    caps = Capabilities(dtypes=(torch.bfloat16,), block_size_multiple=128, max_block_size=512,
                        head_size_multiple=16, max_head_size=256, batch_invariant={})
    for kw, msg in ((dict(block_size=16), "--block-size on x: expected a multiple of 128 in [128, 512], got 16"),
                    (dict(block_size=640), "got 640"), (dict(dtype=torch.float32), "--dtype on x: expected one "
                                                                                     "of bfloat16, got float32"),
                    (dict(head_size=72), "the model's head size on x: expected a multiple of 16 in [16, 256], "
                                         "got 72")):
        with pytest.raises(ValueError) as e:
            caps.check("x", **kw)
        assert str(e.value).endswith(msg), e.value
    caps.check("x", block_size=384, dtype=torch.bfloat16, head_size=64)
    assert [caps.block_size_near(n) for n in (1, 16, 129, 4096)] == [128, 128, 256, 512]
    assert not caps.invariant(torch.bfloat16, "decode") and Capabilities(dtypes=()).invariant(torch.float16, "engine")
    listed = Capabilities(dtypes=(torch.float16,), head_sizes=(64, 80, 128))
    assert [listed.head_size_near(n) for n in (16, 72, 128, 256)] == [64, 80, 128, 128]
    with pytest.raises(ValueError, match="head size on x: expected one of 64, 80, 128, got 96$"):
        listed.check("x", head_size=96)


# ---- end to end through the CLI ----------------------------------------------

@pytest.fixture(scope="session")
def plugin_env(tmp_path_factory):
    """The example plugin made importable without pip, with its real entry point."""
    return entry_point_site.plugin_env(PLUGIN_DIR, tmp_path_factory.mktemp("plugin_site"))


def _conformance(device, tmp_path, env=None, *extra):
    report = tmp_path / f"{device}.json"
    proc = subprocess.run([str(PAGED), "conformance", "--device", device, "--json", str(report), *extra],
                          capture_output=True, text=True, env=env, timeout=600)
    assert report.exists(), proc.stdout + proc.stderr
    return proc, json.loads(report.read_text())


def _check_report(proc, rep, device):
    assert rep["platform"] == device
    assert proc.returncode == (0 if rep["passed"] else 1), proc.stdout + proc.stderr
    for r in rep["results"]:
        assert r["status"] in (PASS, FAIL, SKIP)
        if r["status"] != PASS:
            assert r["detail"], f"{r['name']} is {r['status']} without saying why"
        assert r["name"] in proc.stdout  # the table lists every check


def test_plugin_passes_the_suite(plugin_env, tmp_path):
    proc, rep = _conformance("reference-cpu", tmp_path, plugin_env, "--quick")
    _check_report(proc, rep, "reference-cpu")
    assert proc.returncode == 0 and rep["passed"], proc.stdout
    status = {r["name"]: r["status"] for r in rep["results"]}
    for name in ("platform.detection", "worker.attention_backend", "platform.capabilities",
                 "pool.random_ops_vs_model", "e2e.kernel_batch_invariance", "kernels.batch_invariance[float32]"):
        assert status[name] == PASS, proc.stdout
    # the 128-only declaration, listed; invariance measured, not asserted
    assert rep["declaration"]["block_sizes"] == "a multiple of 128 in [128, 512]", rep["declaration"]
    assert "declared: dtypes float32, bfloat16; block sizes a multiple of 128" in proc.stdout
    detail = {r["name"]: r["detail"] for r in rep["results"]}
    assert "not declared batch invariant" in detail["kernels.batch_invariance[float32]"], detail


def test_engine_refuses_an_undeclared_block_size(plugin_env):
    proc = subprocess.run([str(PAGED), "--device", "reference-cpu", "generate", "--block-size", "16", "hi"],
                          capture_output=True, text=True, env=plugin_env, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "--block-size on reference-cpu: expected a multiple of 128 in [128, 512], got 16" in proc.stderr


def test_cpu_suite(tmp_path):
    proc, rep = _conformance("cpu", tmp_path, None, "--quick")
    _check_report(proc, rep, "cpu")
    assert proc.returncode == 0 and rep["passed"], proc.stdout
    status = {r["name"]: r["status"] for r in rep["results"]}
    for name in ("platform.detection", "platform.memory", "platform.dtypes", "pool.random_ops_vs_model",
                 "pool.bad_use_errors"):
        assert status[name] == PASS, proc.stdout


def test_unknown_device_is_one_line_error():
    proc = subprocess.run([str(PAGED), "conformance", "--device", "no-such-chip"], capture_output=True, text=True)
    assert proc.returncode == 2 and "no-such-chip" in proc.stderr and "Traceback" not in proc.stderr
