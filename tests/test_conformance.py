"""The conformance suite as a product: runner behaviour, that its checks can
fail, and full CLI runs for cpu and for the example third-party plugin."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

from paged.backends.reference import ReferenceBackend
from paged.core.block_pool_model import BlockPoolModel
from paged.core.conformance import e2e_checks, pool_checks
from paged.core.conformance.runner import FAIL, PASS, SKIP, Check, Context, Report, Skip, run_check
from paged.platforms.base import Availability, MemoryInfo, Platform

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

class _Platform(Platform):
    """A minimal in-test platform whose pieces a test can swap for broken ones."""
    name, device_type, default_block_size = "test", "cpu", 16
    backend_cls, pool_cls = ReferenceBackend, BlockPoolModel

    def is_available(self):
        return Availability(True)

    def device_count(self):
        return 1

    def memory_info(self):
        return MemoryInfo(2**30, 2**29)

    def supported_dtypes(self):
        return [torch.float32]

    def attention_backend_cls(self):
        return self.backend_cls

    def block_pool_cls(self):
        return self.pool_cls


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
    p.pool_cls = _LifoFreePool
    r = run_check(Check("pool", pool_checks._random_sequence), Context(p, quick=True))
    assert r.status == FAIL and "free_queue differs from the model" in r.detail


def test_batch_invariance_check_catches_a_batch_dependent_backend():
    p = _Platform()
    ok = run_check(Check("bi", e2e_checks._batch_invariance), Context(p, quick=True))
    assert ok.status == PASS and ok.max_error == 0.0
    p.backend_cls = _BatchDependentBackend
    bad = run_check(Check("bi", e2e_checks._batch_invariance), Context(p, quick=True))
    assert bad.status == FAIL and "batch composition" in bad.detail


# ---- end to end through the CLI ----------------------------------------------

@pytest.fixture(scope="session")
def plugin_env(tmp_path_factory):
    """The example plugin made importable without pip: its source dir on
    PYTHONPATH plus a .dist-info generated from its own pyproject.toml, so
    importlib.metadata finds the real entry point."""
    meta = tomllib.loads((PLUGIN_DIR / "pyproject.toml").read_text())["project"]
    site = tmp_path_factory.mktemp("plugin_site")
    info = site / f"{meta['name'].replace('-', '_')}-{meta['version']}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {meta['name']}\nVersion: {meta['version']}\n")
    eps = meta["entry-points"]["paged.platforms"]
    (info / "entry_points.txt").write_text("[paged.platforms]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(PLUGIN_DIR), env.get("PYTHONPATH", "")])
    return env


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
    for name in ("platform.detection", "platform.attention_backend", "pool.random_ops_vs_model",
                 "e2e.kernel_batch_invariance"):
        assert status[name] == PASS, proc.stdout


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
