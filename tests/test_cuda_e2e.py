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
