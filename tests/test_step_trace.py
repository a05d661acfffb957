"""PAGED_STEP_TRACE (core/engine/step_trace.py) and its summary
(benchmarks/step_trace.py) on a real engine: one line per step that ran
work, whose rows add up to what the requests asked for (their prompt
tokens, and one generated token per decode row), read back by the summary."""

from __future__ import annotations

import json
import logging
import os
import sys

import pytest

from paged.core.engine import step_trace
from paged.core.engine.sampling_params import SamplingParams

from conftest import BENCHMARKS, in_benchmarks, load_benchmark, step_until_idle

summary = load_benchmark("step_trace")


def test_loading_the_summary_leaves_benchmarks_off_sys_path():
    # on the path, a benchmarks/kernels.py shadowed the `kernels` package and
    # every later transformers import in the session failed
    assert str(BENCHMARKS) not in sys.path
    top_level_from_benchmarks = [name for name, m in list(sys.modules.items())
                                 if in_benchmarks(getattr(m, "__file__", None))
                                 and not name.startswith("paged_benchmarks_")]
    assert top_level_from_benchmarks == []


def small_engine(model_path):
    from paged.core.engine.engine import Engine
    from paged.core.engine.config import EngineConfig

    return Engine(EngineConfig(model=str(model_path), device="cpu", max_model_len=256, max_num_seqs=4,
                               max_num_batched_tokens=64, enable_prefix_caching=False, kv_cache_memory="32MiB",
                               cpu_threads_bind=str(min(os.sched_getaffinity(0)))))


def test_trace_rows_add_up_to_the_requests(default_model_path, tmp_path, monkeypatch):
    path = tmp_path / "steps.jsonl"
    monkeypatch.setenv(step_trace.ENV, str(path))
    engine = small_engine(default_model_path)
    prompts = {"a": "The capital of France is", "b": "Write a long story about a lighthouse keeper. " * 8}
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    steps_run = 0
    step = engine.step

    def counting_step():
        nonlocal steps_run
        steps_run += 1
        return step()

    engine.step = counting_step
    final, failures = step_until_idle(engine)
    engine.close()
    assert not failures and set(final) == set(prompts)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(lines) == steps_run  # every step here ran work (no warm-up lines: traced after it)
    prompt_tokens = sum(len(o.prompt_token_ids) for o in final.values())
    generated = sum(len(o.outputs[0].token_ids) for o in final.values())
    assert sum(s["prompt_rows"] for s in lines) == prompt_tokens
    # each request's first token comes from its last prompt row, the rest from decode rows
    assert sum(s["decode_rows"] for s in lines) == generated - len(prompts)
    assert all(0 < s["forward_s"] <= s["step_s"] and s["seqs"] >= 1 for s in lines)
    assert all(a["start"] <= b["start"] for a, b in zip(lines, lines[1:]))
    # the 64-token step budget chunks the long prompt: some steps carry prompt rows beside a decode
    report = summary.summarize(summary.load(str(path)))
    assert report["steps"] == steps_run
    assert sum(k["prompt_rows"] for k in report["kinds"].values()) == prompt_tokens
    assert sum(k["steps"] for k in report["kinds"].values()) == steps_run
    assert "mixed" in report["kinds"] and "decode-only" in report["kinds"]


def test_fit_recovers_known_costs():
    steps = [{"start": i, "step_s": 0, "decode_rows": d, "prompt_rows": p, "forward_s": 0.005 + 0.001 * d + 0.0005 * p}
             for i, (d, p) in enumerate([(1, 0), (4, 0), (16, 0), (8, 40), (2, 100), (0, 256), (12, 7)])]
    assert summary.fit(steps) == pytest.approx({"a_ms": 5.0, "c_decode_ms": 1.0, "c_prompt_ms": 0.5})
    assert summary.fit([{**s, "prompt_rows": 0} for s in steps[:3]]) == {}  # undetermined: no prompt rows


def test_unset_or_unwritable_path_means_no_trace(tmp_path, monkeypatch, caplog):
    monkeypatch.delenv(step_trace.ENV, raising=False)
    assert step_trace.from_env() is None
    monkeypatch.setenv(step_trace.ENV, str(tmp_path / "no" / "such" / "dir" / "steps.jsonl"))
    with caplog.at_level(logging.WARNING, logger="paged.step_trace"):
        assert step_trace.from_env() is None
    assert "cannot write the step trace" in caplog.text


def test_summary_rejects_an_empty_or_foreign_file(tmp_path, capsys):
    empty, foreign = tmp_path / "empty.jsonl", tmp_path / "foreign.jsonl"
    empty.write_text("")
    foreign.write_text("not json\n")
    assert summary.main([str(empty)]) == 2
    assert "no steps" in capsys.readouterr().err
    assert summary.main([str(foreign)]) == 2
    assert "foreign.jsonl:1: not a step trace line" in capsys.readouterr().err
    assert summary.main([str(tmp_path / "missing.jsonl")]) == 2
