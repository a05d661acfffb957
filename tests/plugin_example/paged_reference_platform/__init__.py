"""An example third-party platform for paged: the host CPU, with the
pure-torch reference attention backend as its kernels.

It needs no change anywhere in paged, and one file: it subclasses Platform
(detection, memory, dtypes, what it accepts in ``capabilities``) and keeps
the generic Worker, which runs the plain torch model with the pure-torch
reference attention; it registers through the ``paged.platforms`` entry
point (see pyproject.toml). A device with kernels of its own subclasses the
Worker to name its attention backend (docs/adding-a-platform.md). Certify it
with ``paged conformance --device reference-cpu``.

Its declaration is deliberately narrower than its kernels: block sizes that
are multiples of 128 only, and no batch invariance promised, like a device
whose operators are tiled and whose work split depends on the batch. The
suite then runs every check on 128-token blocks and reports the measured
batch differences instead of asserting them; the engine refuses any other
block size at start.
"""

from __future__ import annotations

import os

from paged.platforms.base import Availability, MemoryInfo, Platform


class ReferenceCpuPlatform(Platform):
    name = "reference-cpu"
    device_type = "cpu"
    dist_backend = "gloo"
    default_block_size = 128

    def is_available(self) -> Availability:
        return Availability(True)

    def device_count(self) -> int:
        return 1

    def memory_info(self) -> MemoryInfo:
        page = os.sysconf("SC_PAGE_SIZE")
        return MemoryInfo(total_bytes=os.sysconf("SC_PHYS_PAGES") * page,
                          available_bytes=os.sysconf("SC_AVPHYS_PAGES") * page)

    def supported_dtypes(self) -> list:
        import torch

        return [torch.float32, torch.bfloat16]

    def capabilities(self):
        from paged.platforms.capabilities import Capabilities

        return Capabilities(dtypes=tuple(self.supported_dtypes()), block_size_multiple=128,
                            max_block_size=512, batch_invariant={})

    # worker_cls(): the base class's generic Worker (torch layer ops, the
    # reference attention, no profiling); block accounting is paged's one,
    # shared by every platform.
