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


@pytest.hookimpl(tryfirst=True)  # before `-m slow` selects: the slow mark added here must be seen
def pytest_collection_modifyitems(config, items):
    import os

    below = _below_native_levels()
    stage = os.environ.get(SLOW_STAGE)
    for item in items:
        level = item.get_closest_marker("isa_level")
        if level and level.args[0] in below:
            item.add_marker(pytest.mark.slow)
            why = f"{level.args[0]} is below this CPU's best level: "
        elif item.get_closest_marker("slow"):
            why = ""
        else:
            continue
        if not stage:
            item.add_marker(pytest.mark.skip(reason=f"{why}slow stage: .ci/run runs it with {SLOW_STAGE}=1"))


def _below_native_levels() -> set[str]:
    """ENGINE_LEVELS under the best one this CPU runs: the README's suite checks the build users get
    here, and the slow stage the older generations forced on it (an AVX2 CPU runs avx2 in both)."""
    try:
        from paged.backends.cpu.host import isa as cpu_isa

        runs = [level for level in LEVEL_NAMES if level in cpu_isa.supported_levels()]
    except ImportError:  # not built: the level fixtures skip on their own
        return set()
    return set(runs[1:])


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
# checks the other generation's dispatch end to end: the best level in the
# README's suite, the lower ones in .ci/run's slow stage. The scalar level is
# checked kernel by kernel, bitwise or within tolerance against the SIMD builds
# (test_kernels, test_quant_linear, test_fused_ops); a whole model at scalar
# speed is ~40x slower, too slow for the suite.
LEVEL_NAMES = ("avx512", "avx2")
#: the fixtures' params, each marked with its level: a level below this CPU's best is a slow-stage test
ENGINE_LEVELS = tuple(pytest.param(level, marks=pytest.mark.isa_level(level)) for level in LEVEL_NAMES)


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
