"""Shared fixtures. ``default_model_path`` fetches the default GGUF once (into
the user cache, see core/models/files.py) and skips when it cannot."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"

#: tests marked ``slow`` run in .ci/run's slow stage (PAGED_SLOW=1 ... -m slow), after the README's command:
#: they leave the README's suite (bounded at 20 minutes on two cores), and CI still runs every test
SLOW_STAGE = "PAGED_SLOW"


def pytest_collection_modifyitems(config, items):
    import os

    if os.environ.get(SLOW_STAGE):
        return
    skip = pytest.mark.skip(reason=f"slow stage: .ci/run runs it with {SLOW_STAGE}=1")
    for item in items:
        if item.get_closest_marker("slow"):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def default_model_path():
    from paged.core.models.files import ModelFetchError, default_model_path as fetch

    try:
        return fetch(quiet=True)
    except ModelFetchError as e:
        pytest.skip(f"default model unavailable: {e}")


@pytest.fixture(scope="session")
def default_model_fp32(default_model_path):
    """The default model's LoadedModel in float32 (config, weights, tokenizer), loaded once."""
    import torch

    from paged.core.models.loaders import load_model_files

    return load_model_files(default_model_path, torch.float32, quiet=True)


# -- CPU generations ----------------------------------------------------------------
# Engine, layer-stack and server tests run once per ISA level this machine
# supports (avx512: Zen 4 / Xeon class; avx2: Zen 3 class), so one machine
# checks the other generation's dispatch end to end. The scalar level is
# checked kernel by kernel, bitwise or within tolerance against the SIMD builds
# (test_kernels, test_quant_linear, test_fused_ops); a whole model at scalar
# speed is ~40x slower, too slow for the suite.
ENGINE_LEVELS = ("avx512", "avx2")


def skip_unless_level(level: str) -> None:
    from paged.backends.cpu.host import isa as cpu_isa

    if level not in cpu_isa.supported_levels():
        pytest.skip(f"this CPU (as PAGED_CPU_HIDE leaves it) cannot run the {level} kernels")


@pytest.fixture(scope="module", params=ENGINE_LEVELS)
def isa_level(request):
    """Every CPU kernel family capped at one level for the module's tests."""
    from paged.backends.cpu.host import isa as cpu_isa

    skip_unless_level(request.param)
    with cpu_isa.use_level(request.param):
        yield request.param


def step_until_idle(engine) -> tuple[dict, dict]:
    """Steps an Engine until idle: (finished outputs, failures), by request id.
    A step that fails some requests (StepFailed) still yields the others'."""
    from paged.core.engine.engine import StepFailed

    final, failures = {}, {}
    while engine.has_unfinished_requests():
        try:
            outputs = engine.step()
        except StepFailed as exc:
            failures.update(exc.errors)
            outputs = exc.outputs
        final.update({o.request_id: o for o in outputs if o.finished})
    return final, failures


def load_benchmark(name: str):
    """benchmarks/<name>.py as a module named ``paged_benchmarks_<name>``.
    The folder is on sys.path only while the file runs (for its sibling
    imports) and those siblings leave sys.modules again: left on the path it
    would shadow installed packages for the rest of the session (a benchmarks/
    kernels.py hid the ``kernels`` package transformers imports)."""
    before, path = set(sys.modules), list(sys.path)
    sys.path.insert(0, str(BENCHMARKS))
    try:
        spec = importlib.util.spec_from_file_location(f"paged_benchmarks_{name}", BENCHMARKS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # while it runs: dataclasses look their module up there
        spec.loader.exec_module(module)
    finally:
        sys.path[:] = path  # the folder (and any copy the module itself added) leaves the path
        for added in set(sys.modules) - before:
            if in_benchmarks(getattr(sys.modules[added], "__file__", None)):
                del sys.modules[added]
    return module


def in_benchmarks(path) -> bool:
    """Whether a module's file (or spec origin; None for built-ins) lies in benchmarks/."""
    return bool(path) and Path(path).resolve().is_relative_to(BENCHMARKS)
