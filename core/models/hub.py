"""Models by name from the Hugging Face Hub: ``--model org/name`` (a repo of
safetensors, or of GGUF files) and ``--model org/name:QUANT`` (one GGUF,
chosen as llama.cpp's ``-hf`` chooses it).

    path = resolve_repo(RepoSpec.parse("bartowski/SmolLM2-135M-Instruct-GGUF:Q4_K_M"), revision=None)

Everything goes through huggingface_hub, so its cache is shared with
transformers, vLLM and the ``hf`` command (``$HF_HUB_CACHE``, else
``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``), ``$HF_ENDPOINT``
(mirrors) and ``$HF_TOKEN`` apply, and a dropped connection resumes where it
stopped (an HTTP Range request). Online, the repo's file list at the
revision comes from the Hub's API, the files are picked from it (below) and
downloaded into the cache with a progress bar on a terminal; the revision's
ref is written, so the same name works offline afterwards. With
``HF_HUB_OFFLINE=1`` (or the Hub unreachable) the files are picked from the
cached snapshot of the revision instead; nothing cached is one line saying so.

Which files:

- ``org/name:QUANT``: the ``.gguf`` file whose path matches QUANT without
  regard to case, as a whole word of the name first (``Q4_K`` is not
  ``Q4_K_M``), else as any part of it; all parts of a split GGUF
  (``-00001-of-00003.gguf``) count as one file and are all fetched. Several
  matches: an error listing them. Vision projectors (``mmproj``) never match.
- ``org/name``: a repo with ``config.json`` and ``*.safetensors`` is a
  Hugging Face model folder (config, tokenizer and generation files, and the
  weight shards the index names); otherwise its one GGUF, or its ``Q4_K_M``
  (llama.cpp's default) when it has several; otherwise an error listing
  the candidates.

Errors are ``HubModelError`` (a ValueError: one line, exit status 2 from
the CLI).
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

logger = logging.getLogger("paged")

#: a Hub repo id (namespace/name), optionally :QUANT
_SPEC = re.compile(r"(?P<repo>[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*)(?::(?P<quant>[A-Za-z0-9_.-]+))?")
_SPLIT = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)
_COMMIT = re.compile(r"[0-9a-f]{40}")
#: what a Hugging Face folder needs beside its weights (the loader and tokenizer read these)
HF_FOLDER_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                   "chat_template.jinja", "model.safetensors.index.json")
#: llama.cpp's choice when a GGUF repo is named without a tag
DEFAULT_QUANT = "Q4_K_M"


class HubModelError(ValueError):
    """A model name that cannot be served: one line, naming what to do."""


@dataclass(frozen=True)
class RepoSpec:
    repo_id: str
    quant: Optional[str] = None

    @classmethod
    def parse(cls, text: str) -> Optional["RepoSpec"]:
        """``org/name`` or ``org/name:QUANT`` -> RepoSpec; anything else
        (a path: absolute, relative with ``./``, ``~``, several ``/``, or
        ending in ``.gguf``) -> None."""
        m = _SPEC.fullmatch(text)
        if m is None or text.lower().endswith(".gguf") or ".." in m["repo"] or "--" in m["repo"]:
            return None
        return cls(m["repo"], m["quant"])

    def __str__(self) -> str:
        return self.repo_id + (f":{self.quant}" if self.quant else "")


class ModelName(str):
    """A ``--model`` string that carries its ``--revision`` (EngineConfig
    hands the pair to the engine, which resolves ``config.model``); compares
    and prints as the name itself."""

    revision: Optional[str]

    def __new__(cls, name: str, revision: Optional[str]):
        obj = super().__new__(cls, name)
        obj.revision = revision
        return obj

    def __reduce__(self):  # tensor parallel ranks get the config pickled
        return (ModelName, (str(self), self.revision))


@dataclass
class Selection:
    """The files of a repo paged serves: a GGUF (all its parts) or a folder."""

    kind: str  # "gguf" | "folder"
    files: list[str]  # repo paths, in download order
    label: str  # for messages: the GGUF's file name, or "safetensors"

    @property
    def entry(self) -> Optional[str]:
        """The path the loader opens inside the snapshot: the GGUF (its first
        part), or None for the snapshot folder itself."""
        return self.files[0] if self.kind == "gguf" else None


# -- choosing files ------------------------------------------------------------

def _gguf_groups(files: Iterable[str]) -> dict[str, list[str]]:
    """GGUF files of a listing, the parts of a split file grouped under one
    key (the name without its -0000i-of-0000n); projectors left out."""
    groups: dict[str, list[str]] = {}
    for f in files:
        if not f.lower().endswith(".gguf") or "mmproj" in f.rsplit("/", 1)[-1].lower():
            continue
        groups.setdefault(_SPLIT.sub(".gguf", f), []).append(f)
    return {k: sorted(v) for k, v in sorted(groups.items())}


def _complete_parts(spec: RepoSpec, key: str, parts: list[str], where: str) -> list[str]:
    split = [_SPLIT.search(p) for p in parts]
    if not any(split):
        return parts[:1]
    total = int(next(m for m in split if m)[2])
    have = sorted(int(m[1]) for m in split if m)
    if have != list(range(1, total + 1)):
        missing = sorted(set(range(1, total + 1)) - set(have))
        raise HubModelError(f"--model {spec}: the split GGUF {key} lacks part(s) {', '.join(map(str, missing))} "
                            f"of {total} {where}")
    return parts


def _match_quant(groups: dict[str, list[str]], quant: str) -> list[str]:
    """Keys matching QUANT: as a whole word of the path (between . - / _ or
    the ends, the way llama.cpp names files) if any does, else as a part."""
    q = quant.lower()
    word = re.compile(rf"(?:^|[./_-]){re.escape(q)}(?:$|[./-])")
    exact = [k for k in groups if word.search(k.lower().removesuffix(".gguf"))]
    return exact or [k for k in groups if q in k.lower()]


def choose_files(spec: RepoSpec, files: list[str], where: str = "in the repo") -> Selection:
    """The files to fetch (or find cached) for ``spec`` from a repo's
    listing; HubModelError when none fits or the choice is ambiguous."""
    groups = _gguf_groups(files)
    names = ", ".join(k.rsplit("/", 1)[-1] for k in groups)
    if spec.quant:
        if not groups:
            raise HubModelError(f"--model {spec}: no .gguf file {where} to match :{spec.quant}"
                                + _has(files))
        found = _match_quant(groups, spec.quant)
        if not found:
            raise HubModelError(f"--model {spec}: no .gguf file {where} matches {spec.quant!r} "
                                f"(they are: {names})")
        if len(found) > 1:
            raise HubModelError(f"--model {spec}: {spec.quant!r} matches {len(found)} GGUF files {where}: "
                                f"{', '.join(found)}; name one of them more exactly")
        return Selection("gguf", _complete_parts(spec, found[0], groups[found[0]], where),
                         found[0].rsplit("/", 1)[-1])
    top = {f for f in files if "/" not in f}
    weights = sorted(f for f in top if f.endswith(".safetensors"))
    if "config.json" in top and weights:
        if "tokenizer.json" not in top:
            raise HubModelError(f"--model {spec}: the repo has safetensors weights but no tokenizer.json "
                                f"{where} (paged reads the tokenizers library's tokenizer.json)")
        return Selection("folder", [f for f in HF_FOLDER_FILES if f in top] + weights, "safetensors")
    if len(groups) == 1:
        key = next(iter(groups))
        return Selection("gguf", _complete_parts(spec, key, groups[key], where), key.rsplit("/", 1)[-1])
    if groups:
        found = _match_quant(groups, DEFAULT_QUANT)
        if len(found) == 1:
            return Selection("gguf", _complete_parts(spec, found[0], groups[found[0]], where),
                             found[0].rsplit("/", 1)[-1])
        raise HubModelError(f"--model {spec}: the repo has {len(groups)} GGUF files {where}: choose one with "
                            f"{spec.repo_id}:QUANT (they are: {names})")
    raise HubModelError(f"--model {spec}: nothing paged can serve {where} (expected a .gguf file, or "
                        f"config.json with *.safetensors)" + _has(files))


def _has(files: list[str], shown: int = 8) -> str:
    if not files:
        return " (it has no files)"
    more = f", ... ({len(files)} files)" if len(files) > shown else ""
    return f" (it has: {', '.join(sorted(files)[:shown])}{more})"


def _weights_named_by_index(selection: Selection, read) -> Selection:
    """A sharded folder: only the shards its index names (repos also carry
    consolidated copies the loader would read twice)."""
    if selection.kind != "folder" or "model.safetensors.index.json" not in selection.files:
        return selection
    try:
        shards = set(json.loads(read("model.safetensors.index.json"))["weight_map"].values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return selection
    keep = [f for f in selection.files if not f.endswith(".safetensors") or f in shards]
    return Selection(selection.kind, keep, selection.label)


# -- the cache -----------------------------------------------------------------

def hub_cache_dir() -> Path:
    """huggingface_hub's cache, read from the environment now (its own
    constants are read once, at import)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def offline() -> bool:
    from huggingface_hub import constants

    flag = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE")
    if flag is not None:
        return flag.strip().upper() in ("1", "ON", "YES", "TRUE")
    return bool(constants.is_offline_mode())


def _endpoint() -> Optional[str]:
    return os.environ.get("HF_ENDPOINT", "").rstrip("/") or None


def repo_folder(repo_id: str) -> Path:
    return hub_cache_dir() / ("models--" + repo_id.replace("/", "--"))


def cached_commit(repo_id: str, revision: str) -> Optional[str]:
    """The commit a revision names in the cache: refs/<revision>, or the
    revision itself when it is a commit with a snapshot."""
    folder = repo_folder(repo_id)
    ref = folder / "refs" / revision
    if ref.is_file():
        return ref.read_text().strip() or None
    if _COMMIT.fullmatch(revision) and (folder / "snapshots" / revision).is_dir():
        return revision
    return None


def _snapshot_files(snapshot: Path) -> list[str]:
    return sorted(p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*")
                  if p.is_file() and ".cache" not in p.relative_to(snapshot).parts)


def _from_cache(spec: RepoSpec, revision: str, why: str) -> Path:
    commit = cached_commit(spec.repo_id, revision)
    snapshot = repo_folder(spec.repo_id) / "snapshots" / (commit or "-")
    if commit is None or not snapshot.is_dir():
        raise HubModelError(f"--model {spec}: revision {revision!r} is not in the Hugging Face cache "
                            f"({hub_cache_dir()}) and {why}: download it once online"
                            + (", or unset HF_HUB_OFFLINE" if offline() else ""))
    where = f"in the cached snapshot {commit[:12]}"
    selection = choose_files(spec, _snapshot_files(snapshot), where)
    selection = _weights_named_by_index(selection, lambda f: (snapshot / f).read_text())
    missing = [f for f in selection.files if not (snapshot / f).is_file()]
    if missing:
        raise HubModelError(f"--model {spec}: {', '.join(missing)} not in the cache ({snapshot}) and {why}")
    logger.info("%s: the cached snapshot %s (%s)", spec, commit[:12], why)
    return _entry(spec, snapshot, selection)


def _entry(spec: RepoSpec, snapshot: Path, selection: Selection) -> Path:
    if selection.kind == "folder":
        return snapshot
    if len(selection.files) > 1:
        # paged's GGUF loader reads one file; the parts stay cached for a merge
        raise HubModelError(
            f"--model {spec}: {selection.label} is a split GGUF of {len(selection.files)} parts (all in "
            f"{snapshot / selection.files[0]}'s folder), and paged loads single GGUF files: merge them with "
            f"llama.cpp's `llama-gguf-split --merge {selection.files[0].rsplit('/', 1)[-1]} merged.gguf` "
            "and pass --model merged.gguf")
    return snapshot / selection.entry


# -- the Hub -------------------------------------------------------------------

def _progress_class(quiet: bool):
    """huggingface_hub's tqdm, drawn only on a terminal (a log keeps one line)."""
    from huggingface_hub.utils import tqdm as hf_tqdm

    draw = not quiet and sys.stderr.isatty()

    class Progress(hf_tqdm):
        def __init__(self, *args, **kwargs):
            if not draw:
                kwargs["disable"] = True
            super().__init__(*args, **kwargs)

    return Progress


def _describe_hub_error(spec: RepoSpec, revision: str, exc: Exception) -> Optional[str]:
    from huggingface_hub import errors

    if isinstance(exc, errors.RevisionNotFoundError):
        return f"--model {spec}: the repo has no revision {revision!r} (--revision)"
    if isinstance(exc, errors.GatedRepoError):
        return (f"--model {spec}: the repo is gated: accept its terms on the Hub and set HF_TOKEN "
                "(or run `hf auth login`)")
    if isinstance(exc, errors.RepositoryNotFoundError):
        return (f"--model {spec}: no such model on the Hub ({_endpoint() or 'huggingface.co'}), nor a local "
                "file or folder (a private repo needs HF_TOKEN)")
    if isinstance(exc, errors.LocalEntryNotFoundError):  # not cached, and no answer from the Hub
        return (f"--model {spec}: lost the Hub while downloading ({str(exc).splitlines()[0][:160]}); "
                "run again to fetch what is missing")
    if isinstance(exc, errors.EntryNotFoundError):
        return f"--model {spec}: a file of the repo vanished while downloading ({exc.__class__.__name__}); retry"
    if isinstance(exc, errors.HFValidationError):
        return f"--model {spec}: not a Hub repo id ({str(exc).splitlines()[0][:160]})"
    if isinstance(exc, errors.HfHubHTTPError):
        status = getattr(getattr(exc, "response", None), "status_code", None)
        return f"--model {spec}: the Hub answered {status or 'an error'}: {str(exc).splitlines()[0][:200]}"
    return None


def _is_unreachable(exc: Exception) -> bool:
    """No answer from the Hub at all (no network, DNS, refused, timed out)."""
    from huggingface_hub import errors

    if isinstance(exc, errors.OfflineModeIsEnabled):
        return True
    names = {c.__name__ for c in type(exc).__mro__}
    return bool(names & {"ConnectError", "ConnectTimeout", "TimeoutException", "ConnectionError", "ProxyError"})


def resolve_repo(spec: RepoSpec, revision: Optional[str] = None, quiet: bool = False) -> Path:
    """The local path of ``spec`` at ``revision`` (default main): a GGUF
    file or a model folder inside the Hub cache's snapshot, downloading
    what is missing. HubModelError for anything the user must fix."""
    revision = revision or "main"
    if offline():
        return _from_cache(spec, revision, "HF_HUB_OFFLINE is set")
    from huggingface_hub import HfApi

    try:
        info = HfApi(endpoint=_endpoint()).model_info(spec.repo_id, revision=revision, files_metadata=True)
    except Exception as exc:  # noqa: BLE001 - sorted below: user errors, or the Hub out of reach
        message = _describe_hub_error(spec, revision, exc)
        if message:
            raise HubModelError(message) from None
        if _is_unreachable(exc):
            return _from_cache(spec, revision, f"the Hub is unreachable ({type(exc).__name__})")
        raise
    commit = info.sha
    sizes = {s.rfilename: s.size for s in info.siblings or ()}
    selection = choose_files(spec, list(sizes))
    if selection.kind == "folder" and "model.safetensors.index.json" in selection.files:
        index = _download(spec, "model.safetensors.index.json", commit, quiet)
        selection = _weights_named_by_index(selection, lambda f: index.read_text())
    missing = [f for f in selection.files if not (repo_folder(spec.repo_id) / "snapshots" / commit / f).is_file()]
    if missing and not quiet:
        total = sum(sizes.get(f) or 0 for f in missing)
        print(f"paged: fetching {spec} ({selection.label}: {len(missing)} file{'s' * (len(missing) > 1)}, "
              f"{_size(total)}) at {commit[:12]} from {_endpoint() or 'https://huggingface.co'} into "
              f"{hub_cache_dir()}", file=sys.stderr, flush=True)
    for f in selection.files:
        _download(spec, f, commit, quiet)
    _write_ref(spec.repo_id, revision, commit)
    return _entry(spec, repo_folder(spec.repo_id) / "snapshots" / commit, selection)


def _download(spec: RepoSpec, filename: str, commit: str, quiet: bool) -> Path:
    from huggingface_hub import hf_hub_download

    try:
        return Path(hf_hub_download(spec.repo_id, filename, revision=commit, cache_dir=hub_cache_dir(),
                                    endpoint=_endpoint(), tqdm_class=_progress_class(quiet)))
    except Exception as exc:  # noqa: BLE001 - one line for what the user can act on
        message = _describe_hub_error(spec, commit, exc)
        if message is None and _is_unreachable(exc):
            message = (f"--model {spec}: lost the Hub while downloading {filename} ({type(exc).__name__}); "
                       "run again to fetch what is missing")
        if message is None and isinstance(exc, OSError):
            message = f"--model {spec}: cannot store {filename} in {hub_cache_dir()}: {exc}"
        if message:
            raise HubModelError(message) from None
        raise


def _write_ref(repo_id: str, revision: str, commit: str) -> None:
    """refs/<revision> -> commit, as huggingface_hub writes it, so the name
    resolves offline; a commit revision needs none."""
    if revision == commit:
        return
    ref = repo_folder(repo_id) / "refs" / revision
    if ref.is_file() and ref.read_text().strip() == commit:
        return
    ref.parent.mkdir(parents=True, exist_ok=True)
    tmp = ref.with_name(ref.name + f".{os.getpid()}.tmp")
    tmp.write_text(commit)
    os.replace(tmp, ref)


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n} B"
