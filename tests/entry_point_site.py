"""Makes a test-only platform package importable with its real entry point,
without pip: its source dir goes on the path, and a .dist-info generated
from its own pyproject.toml goes in ``site`` so importlib.metadata finds the
``paged.platforms`` entry point (used for tests/plugin_example and
tests/npu_sim)."""

from __future__ import annotations

import os
import tomllib
from pathlib import Path


def write_dist_info(package_dir: Path, site: Path) -> None:
    meta = tomllib.loads((package_dir / "pyproject.toml").read_text())["project"]
    info = site / f"{meta['name'].replace('-', '_')}-{meta['version']}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {meta['name']}\nVersion: {meta['version']}\n")
    eps = meta["entry-points"]["paged.platforms"]
    (info / "entry_points.txt").write_text("[paged.platforms]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()))


def plugin_env(package_dir: Path, site: Path) -> dict:
    """os.environ plus PYTHONPATH reaching the package and its entry point."""
    write_dist_info(package_dir, site)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(package_dir), env.get("PYTHONPATH", "")])
    return env
