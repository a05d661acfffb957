"""An example third-party platform for paged: the host CPU, with the
pure-torch reference attention backend as its kernels.

It needs no change anywhere in paged: it subclasses Platform, names an
attention backend and the Worker that runs models on it, declares what it
accepts (``capabilities``), keeps the shared block accounting, and registers
through the ``paged.platforms`` entry point (see pyproject.toml). Certify it
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

    def attention_backend_cls(self):
        from paged.backends.reference.attention import ReferenceBackend

        return ReferenceBackend

    def worker_cls(self):
        # the generic Worker: torch layer ops, no stack runner, no profiling;
        # a device with fused ops or a memory peak to measure subclasses it
        from paged.core.engine.worker import Worker

        return Worker

    # block_pool_cls(): the one block accounting every platform shares (base class).
