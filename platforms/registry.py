"""Platform registry: every platform, built-in or third-party, is an entry
point in the ``paged.platforms`` group.

The built-ins (cpu, cuda, npu) are declared in paged's own pyproject.toml
exactly as a plugin declares itself, so adding a platform touches no list
here. Entry points are loaded only when asked for: a missing or broken
cuda/npu module never breaks cpu, and nothing here imports torch, torch_npu
or touches CUDA until a platform is chosen.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from importlib import metadata

from paged.platforms.base import Platform, PlatformUnavailable

#: entry-point group every platform registers in; the entry point loads a
#: Platform subclass, e.g. ``mychip = mychip_paged:MyChipPlatform``
ENTRY_POINT_GROUP = "paged.platforms"
#: the distribution whose entry points are the built-ins: they may join
#: "auto" and cannot be shadowed by a plugin of the same name
BUILTIN_DISTRIBUTION = "paged"
#: environment variable current_platform() reads when none was set
DEVICE_ENV = "PAGED_DEVICE"

_current: Platform | None = None


@dataclass(frozen=True)
class Registered:
    """One name in the group: where it loads from and whether paged ships it."""

    name: str
    value: str  # "module:attr"
    builtin: bool
    entry_point: metadata.EntryPoint


def _one_line(text: object) -> str:
    return " ".join(str(text).split())


def _is_builtin(ep: metadata.EntryPoint) -> bool:
    dist = getattr(ep, "dist", None)
    return dist is not None and dist.metadata["Name"] == BUILTIN_DISTRIBUTION


def registered() -> dict[str, Registered]:
    """Every registered name, built-ins first (sorted), then plugins (sorted).
    A plugin cannot shadow a built-in name; of two plugins the first found wins."""
    found: dict[str, Registered] = {}
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        entry = Registered(ep.name, ep.value, _is_builtin(ep), ep)
        if ep.name not in found or (entry.builtin and not found[ep.name].builtin):
            found[ep.name] = entry
    return dict(sorted(found.items(), key=lambda kv: (not kv[1].builtin, kv[0])))


def builtin_names() -> list[str]:
    return [name for name, r in registered().items() if r.builtin]


def _unknown(name: str, known: dict[str, Registered]) -> PlatformUnavailable:
    return PlatformUnavailable(
        f"unknown platform {name!r} (known: {', '.join(known)}, auto); "
        f"third-party platforms register in the {ENTRY_POINT_GROUP!r} entry-point group")


def load_platform_class(name: str) -> type[Platform]:
    """The Platform subclass registered as ``name``; PlatformUnavailable
    (one line) when unknown or when its module cannot be loaded."""
    known = registered()
    entry = known.get(name)
    if entry is None:
        raise _unknown(name, known)
    try:
        cls = entry.entry_point.load()
    except ModuleNotFoundError as e:
        module_name = entry.value.partition(":")[0]
        if entry.builtin and e.name and module_name.startswith(e.name):
            raise PlatformUnavailable(f"platform {name!r} is not part of this build ({module_name} is missing)") from e
        raise PlatformUnavailable(f"platform {name!r} needs the Python package {e.name!r}: pip install {e.name}") from e
    except Exception as e:  # ImportError, AttributeError, or the plugin's own failure
        raise PlatformUnavailable(
            f"platform {name!r} cannot be loaded from {entry.value}: {type(e).__name__}: {_one_line(e)}") from e
    if not (isinstance(cls, type) and issubclass(cls, Platform)):
        raise PlatformUnavailable(f"platform {name!r} entry point does not load a Platform subclass (got {cls!r})")
    return cls


def list_platforms() -> dict[str, type[Platform] | str]:
    """Every registered name -> its class, or the one-line reason it cannot load."""
    result: dict[str, type[Platform] | str] = {}
    for name in registered():
        try:
            result[name] = load_platform_class(name)
        except PlatformUnavailable as e:
            result[name] = str(e)
    return result


def auto_order() -> list[str]:
    """The built-ins "auto" tries, highest ``Platform.auto_priority`` first
    (cuda > npu > cpu); plugins and priority 0 are used only when named."""
    ranked = []
    for name in builtin_names():
        try:
            priority = load_platform_class(name).auto_priority
        except PlatformUnavailable:
            continue
        if priority > 0:
            ranked.append((-priority, name))
    return [name for _, name in sorted(ranked)]


def get_platform(name: str = "auto") -> Platform:
    """An available platform instance. ``auto``: the first of cuda > npu > cpu
    that is available. Raises PlatformUnavailable with one line otherwise."""
    name = (name or "auto").strip().lower()
    if name == "auto":
        reasons = []
        for candidate in auto_order():
            try:
                return get_platform(candidate)
            except PlatformUnavailable as e:
                reasons.append(str(e))
        raise PlatformUnavailable("no platform is available: " + ("; ".join(reasons) or
                                  f"no built-in platform is registered in {ENTRY_POINT_GROUP!r} "
                                  "(reinstall paged: pip install -e .)"))
    platform = load_platform_class(name)()
    availability = platform.is_available()
    if not availability.ok:
        raise PlatformUnavailable(f"platform {name!r} is not available: {_one_line(availability.reason)}")
    return platform


def current_platform() -> Platform:
    """The platform of this process: the one set, else $PAGED_DEVICE, else auto."""
    global _current
    if _current is None:
        _current = get_platform(os.environ.get(DEVICE_ENV, "auto"))
    return _current


def set_current_platform(platform: Platform | str | None) -> Platform | None:
    """Choose the process's platform (an instance or a name); None forgets it."""
    global _current
    _current = get_platform(platform) if isinstance(platform, str) else platform
    return _current
