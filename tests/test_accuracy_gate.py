"""The accuracy contract: every CPU compute path against HF transformers
float32 on held-out data (tests/data/accuracy/, the check half; see
benchmarks/accuracy_gate.py for the measures and floors.json for the floors
and how each was derived).

- quick (the default suite, well under a minute): the default path on the
  quick subset of the check half (floors.json "quick");
- full (PAGED_ACCURACY_FULL=1, .ci/run's accuracy stage): every documented
  path on the whole check half; what `auto` may choose must reach
  max(llama.cpp, the bfloat16 path), and int8 activations everywhere, the
  deliberately degraded path, must not (so the gate can fail).
Paths this CPU cannot run (mixed-bf16 without AMX) skip with the reason.
"""

from __future__ import annotations

import os

import pytest

from conftest import load_benchmark

gate = load_benchmark("accuracy_gate")
REFERENCE, FLOORS = gate.load_data()
FULL = os.environ.get("PAGED_ACCURACY_FULL") == "1"


def test_reference_data_is_for_the_default_model(default_model_path):
    assert os.path.basename(default_model_path) == REFERENCE["model"]["file"]
    assert REFERENCE["llama.cpp"], "the reference data should carry llama.cpp's tokens (the auto floor needs them)"
    for half in ("tune", "check"):
        assert len(REFERENCE["prompts"][half]) == len(FLOORS["bfloat16_agree_per_prompt"])
        assert all(len(p["hf"]) == REFERENCE["new_tokens"] for p in REFERENCE["prompts"][half])


def check(report: dict, name: str) -> None:
    if name in report["skipped"]:
        pytest.skip(report["skipped"][name])
    assert name not in report["failed"], f"{name}: {'; '.join(report['failed'][name])}"


def test_quick_gate_default_path(default_model_path):
    report = gate.gate(["auto"], "check", quick=True)
    gate.print_report(report)  # pytest -s shows the table
    check(report, "auto")


@pytest.fixture(scope="module")
def full_report(default_model_path):
    if not FULL:
        pytest.skip("the full accuracy gate runs in .ci/run (PAGED_ACCURACY_FULL=1): ~5 min")
    report = gate.gate(list(FLOORS["paths"]), "check")
    gate.print_report(report)
    return report


@pytest.mark.parametrize("name", list(FLOORS["paths"]))
def test_full_gate(full_report, name):
    check(full_report, name)


def test_full_gate_can_fail(full_report):
    """int8 everywhere is below what auto may choose: the gate tells them apart."""
    int8 = full_report["rows"]["int8"]
    assert int8["agree"] < full_report["auto_floor"]
