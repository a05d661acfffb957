"""The CPU side of the GPU end-to-end check (benchmarks/gpu_e2e.py, run by
.ci/gpu_check.sh on a lent GPU): the generated model loads and runs on the
CPU engine (the oracle the GPU is compared with), the comparison accepts
exactly what it says it accepts."""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import pytest

from conftest import load_benchmark
from paged.core.models.loaders import load_model_files

e2e = load_benchmark("gpu_e2e")


def _digest(folder: Path) -> str:
    return hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()


def test_generated_model_is_deterministic_gqa_and_head_size_80(tmp_path):
    a = e2e.write_tiny_llama(tmp_path / "a")
    assert _digest(a) == _digest(e2e.write_tiny_llama(tmp_path / "b"))
    assert _digest(a) != _digest(e2e.write_tiny_llama(tmp_path / "c", seed=1))
    cfg = load_model_files(a, quiet=True).config
    assert (cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.num_layers) == (80, 8, 2, 4)
    from paged.backends.cuda.attention import SUPPORTED_HEAD_SIZES

    assert cfg.head_dim in SUPPORTED_HEAD_SIZES


def test_cpu_oracle_runs_the_generated_model(tmp_path):
    from paged import LLM

    llm = LLM(model=str(e2e.write_tiny_llama(tmp_path)), device="cpu", dtype="float32", kv_cache_memory="64MiB",
              max_model_len=256, seed=0)
    ps = [p[:40] for p in e2e.prompts()[:3]]
    tokens, margins = e2e.greedy(llm, ps)
    assert [len(t) for t in tokens] == [e2e.MAX_TOKENS] * 3
    assert all(m >= 0 for ms in margins for m in ms)
    again, _ = e2e.greedy(llm, ps)
    assert e2e.compare_greedy(tokens, margins, again, 0.0) == [
        {"prompt": i, "tokens": e2e.MAX_TOKENS, "first_divergence": None, "margin": None, "ok": True}
        for i in range(3)]


def test_compare_accepts_divergence_only_below_the_margin():
    want = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9]]
    margins = [[3.0, 0.2, 2.0, 2.0], [3.0, 3.0, 3.0, 3.0], [1.0, 1.0]]
    got = [[1, 2, 9, 9], [5, 7, 7, 8], [9, 9]]
    r = e2e.compare_greedy(want, margins, got, threshold=2.5)
    assert [(x["first_divergence"], x["margin"], x["ok"]) for x in r] == [(2, 2.0, True), (1, 3.0, False),
                                                                         (None, None, True)]
    r = e2e.compare_greedy(want, margins, got, threshold=1.0)
    assert [x["ok"] for x in r] == [False, False, True]
    short = e2e.compare_greedy([[1, 2, 3]], [[5.0, 5.0, 5.0]], [[1, 2]], threshold=1.0)
    assert short[0]["first_divergence"] == 2 and not short[0]["ok"]  # a missing token is a divergence
    line = e2e.summarize("x", e2e.compare_greedy(want, margins, got, 2.5), 2.5)
    assert line.startswith("FAIL x: 1/3 prompts equal; diverged: prompt 0 at token 2 (margin 2)")
    with pytest.raises(ValueError):
        e2e.compare_greedy(want, margins, got[:2], 1.0)  # one result per prompt, never silently fewer


def test_top2_margin():
    assert e2e.top2_margin({1: -0.1, 2: -2.6, 3: -5.0}) == pytest.approx(2.5)
    assert e2e.top2_margin({1: -0.0}) == math.inf


def test_stream_completion_against_a_cpu_server(tmp_path):
    # the serve stage's client logic, against the same server on the CPU
    line = e2e.stream_completion(e2e.write_tiny_llama(tmp_path), e2e._free_port(), device="cpu")
    assert line.startswith("PASS serve: HTTP 200, 8 streamed chunks, [DONE] True"), line


def test_run_engine_frees_the_engine_before_the_next():
    """The old ``_release(llm)`` deleted its own argument only: the caller's
    name kept the engine alive, so the next engine profiled the first one's
    KV arena as used. run_engine closes the engine, drops it and checks."""
    import gc
    import weakref

    made = []

    class FakeLLM:
        closed = False

        def close(self):
            self.closed = True

    def make():
        made.append(weakref.ref(llm := FakeLLM()))
        return llm

    assert e2e.run_engine(make, lambda llm: 7) == 7
    gc.collect()
    assert made[0]() is None  # gone once run_engine returned
    kept = []
    with pytest.raises(e2e.EngineLeaked, match="still referenced after its run"):
        e2e.run_engine(make, kept.append)  # work that keeps the engine is caught
    assert kept[0].closed


def test_gpu_check_fails_when_the_cuda_module_was_not_built(tmp_path):
    """pip succeeds when CMake skips csrc_cuda (no nvcc): the script must
    say BUILD FAILED, not "built". Here the build is a stub that succeeds
    and the module found is this machine's, compiled for other archs than
    the script asks for (it was "built" and went on before)."""
    import os
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[1]
    stub = tmp_path / "python"
    stub.write_text(f"""#!/bin/sh
case "$*" in
  *"pip install"*) exit 0 ;;                      # "built" (as when CMake skipped csrc_cuda)
  *"-c"*) exec {sys.executable} "$@" ;;           # the checks run for real
  *) echo "stage ran: $*"; exit 0 ;;              # tests, e2e, conformance, benchmarks: must not run
esac
""")
    stub.chmod(0o755)
    env = dict(os.environ, PYTHON=str(stub), OUT=str(tmp_path / "out"), PATH="/usr/bin:/bin")
    try:
        from paged import _C_cuda
        built = _C_cuda.built_archs
    except ImportError:
        built = None
    if built == "90":
        pytest.skip("this machine's _C_cuda was built for exactly sm_90: nothing to mismatch")
    proc = subprocess.run(["bash", ".ci/gpu_check.sh"], cwd=repo, env=env, capture_output=True, text=True,
                          timeout=120)
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "BUILD FAILED: paged._C_cuda built_archs" in summary and "expected '90'" in summary, summary
    assert "stage ran" not in proc.stdout + summary
