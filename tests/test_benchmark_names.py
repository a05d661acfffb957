"""`python benchmarks/X.py` puts benchmarks/ first on sys.path, so a script
named like an installed module hides it from every import in that run
(benchmarks/kernels.py once hid the `kernels` package transformers needs)."""

from __future__ import annotations

import importlib.util

import pytest

from conftest import BENCHMARKS, in_benchmarks

SCRIPTS = sorted(p.stem for p in BENCHMARKS.glob("*.py"))


@pytest.mark.parametrize("name", SCRIPTS)
def test_no_benchmark_script_shadows_an_installed_module(name):
    spec = importlib.util.find_spec(name)
    assert spec is None or in_benchmarks(spec.origin), \
        f"benchmarks/{name}.py shadows {spec.origin}; rename the script"
