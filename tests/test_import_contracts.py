"""The import-linter contracts of pyproject.toml ([tool.importlinter]) hold:
core/ imports no backend package and no compiled module, and the layers
entrypoints -> engine -> platform interface are never crossed upwards."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("importlinter", reason="pip install -e '.[test]' installs import-linter")

ROOT = Path(__file__).resolve().parents[1]
#: where each part of the installed package lives in the repository (pyproject's wheel.packages)
LAYOUT = {"paged": ROOT / "core" / "_root" / "paged", "paged/core": ROOT / "core",
          "paged/backends": ROOT / "backends", "paged/platforms": ROOT / "platforms"}
COMPILED = ("_C_cpu", "_C_cuda", "_C_ascend")

# import-linter walks one folder per package, and the editable install's
# finder maps paged/ from four: run it on a copy laid out as installed, with
# the editable finder removed so ``paged`` resolves to the copy.
RUNNER = """
import sys
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in type(f).__module__]
sys.path.insert(0, sys.argv[1])
from importlinter.cli import lint_imports
sys.exit(lint_imports(config_filename=sys.argv[2], no_cache=True))
"""


def installed_copy(tmp_path: Path) -> Path:
    for dest, src in LAYOUT.items():
        shutil.copytree(src, tmp_path / dest, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("_root", "__pycache__", "*.so"))
    for name in COMPILED:  # stand-ins, so importing a compiled module is an edge in the graph
        (tmp_path / "paged" / f"{name}.py").write_text("# stand-in for the extension module\n")
    return tmp_path


def test_import_contracts_hold(tmp_path):
    tree = installed_copy(tmp_path)
    out = subprocess.run([sys.executable, "-c", RUNNER, str(tree), str(ROOT / "pyproject.toml")],
                         capture_output=True, text=True, cwd=tree, timeout=300)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "Contracts: 3 kept, 0 broken" in out.stdout


def test_contracts_catch_a_device_import_in_core(tmp_path):
    """The check is real: one CPU import added to the model breaks it."""
    tree = installed_copy(tmp_path)
    llama = tree / "paged" / "core" / "models" / "llama.py"
    llama.write_text(llama.read_text() + "\nfrom paged.backends.cpu.layer_stack import LayerStack  # noqa\n")
    out = subprocess.run([sys.executable, "-c", RUNNER, str(tree), str(ROOT / "pyproject.toml")],
                         capture_output=True, text=True, cwd=tree, timeout=300)
    assert out.returncode != 0 and "paged.core.models.llama -> paged.backends.cpu.layer_stack" in out.stdout
