"""Platform interface, built-in platforms (cpu, cuda, npu) and the registry.

Importing this package never imports torch, torch_npu or initialises CUDA.
"""

import os

# With torch-npu installed but no CANN runtime, `import torch` itself fails,
# because torch auto-loads device backends (torch_npu) at import. Turn that
# off before anything imports torch; the npu platform imports torch_npu
# explicitly when it is chosen. Users can still override it.
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

from paged.platforms.base import Availability, MemoryInfo, Platform, PlatformUnavailable  # noqa: E402
from paged.platforms.registry import (  # noqa: E402
    ENTRY_POINT_GROUP,
    auto_order,
    builtin_names,
    current_platform,
    get_platform,
    list_platforms,
    load_platform_class,
    set_current_platform,
)

__all__ = [
    "Availability", "ENTRY_POINT_GROUP", "MemoryInfo", "Platform", "PlatformUnavailable", "auto_order",
    "builtin_names", "current_platform", "get_platform", "list_platforms", "load_platform_class",
    "set_current_platform",
]
