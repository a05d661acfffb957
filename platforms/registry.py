"""Platform registry: built-ins (cpu, cuda, npu) and entry-point plugins.

Built-in platform modules are imported only when asked for, so a missing or
broken cuda/npu module never breaks cpu, and nothing here imports torch,
torch_npu or touches CUDA until a platform is chosen.
"""

from __future__ import annotations

import importlib
import os
from importlib import metadata

from paged.platforms.base import Platform, PlatformUnavailable

#: entry-point group third-party platforms register in; the entry point
#: loads a Platform subclass, e.g. ``mychip = mychip_paged:MyChipPlatform``
ENTRY_POINT_GROUP = "paged.platforms"
BUILTIN_PLATFORMS = {
    "cpu": "paged.platforms.cpu:CpuPlatform",
    "cuda": "paged.platforms.cuda:CudaPlatform",
    "npu": "paged.platforms.npu:NpuPlatform",
}
#: "auto" takes the first available, in this order (plugins are explicit-only)
AUTO_ORDER = ("cuda", "npu", "cpu")
#: environment variable current_platform() reads when none was set
DEVICE_ENV = "PAGED_DEVICE"

_current: Platform | None = None


def _one_line(text: object) -> str:
    return " ".join(str(text).split())


def _plugin_entry_points() -> dict[str, metadata.EntryPoint]:
    """Plugins by name; a plugin cannot shadow a built-in name."""
    found = {}
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.name not in BUILTIN_PLATFORMS:
            found.setdefault(ep.name, ep)
    return found


def _known_names(plugins: dict) -> str:
    return ", ".join([*BUILTIN_PLATFORMS, *sorted(plugins)])


def load_platform_class(name: str) -> type[Platform]:
    """The Platform subclass registered as ``name``; PlatformUnavailable
    (one line) when unknown or when its module cannot be loaded."""
    plugins = _plugin_entry_points()
    try:
        if name in BUILTIN_PLATFORMS:
            module_name, _, attr = BUILTIN_PLATFORMS[name].partition(":")
            cls = getattr(importlib.import_module(module_name), attr)
        elif name in plugins:
            cls = plugins[name].load()
        else:
            raise PlatformUnavailable(
                f"unknown platform {name!r} (known: {_known_names(plugins)}, auto); "
                f"third-party platforms register in the {ENTRY_POINT_GROUP!r} entry-point group"
            )
    except PlatformUnavailable:
        raise
    except ModuleNotFoundError as e:
        module_name = BUILTIN_PLATFORMS.get(name, "").partition(":")[0]
        if module_name and e.name and module_name.startswith(e.name):
            raise PlatformUnavailable(f"platform {name!r} is not part of this build ({module_name} is missing)") from e
        raise PlatformUnavailable(f"platform {name!r} needs the Python package {e.name!r}: pip install {e.name}") from e
    except Exception as e:  # ImportError, AttributeError, or the plugin's own failure
        where = BUILTIN_PLATFORMS.get(name) or plugins[name].value
        raise PlatformUnavailable(
            f"platform {name!r} cannot be loaded from {where}: {type(e).__name__}: {_one_line(e)}"
        ) from e
    if not (isinstance(cls, type) and issubclass(cls, Platform)):
        raise PlatformUnavailable(f"platform {name!r} entry point does not load a Platform subclass (got {cls!r})")
    return cls


def list_platforms() -> dict[str, type[Platform] | str]:
    """Every registered name -> its class, or the one-line reason it cannot load."""
    result: dict[str, type[Platform] | str] = {}
    for name in [*BUILTIN_PLATFORMS, *sorted(_plugin_entry_points())]:
        try:
            result[name] = load_platform_class(name)
        except PlatformUnavailable as e:
            result[name] = str(e)
    return result


def get_platform(name: str = "auto") -> Platform:
    """An available platform instance. ``auto``: the first of cuda > npu > cpu
    that is available. Raises PlatformUnavailable with one line otherwise."""
    name = (name or "auto").strip().lower()
    if name == "auto":
        reasons = []
        for candidate in AUTO_ORDER:
            try:
                return get_platform(candidate)
            except PlatformUnavailable as e:
                reasons.append(str(e))
        raise PlatformUnavailable("no platform is available: " + "; ".join(reasons))
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
