"""npu-sim: a SIMULATED Ascend NPU platform, for tests only.

It is paged's own NpuPlatform and NpuBackend (layouts, per-step metadata,
masks, slot mapping, the Q_S = 1 route, the capability declaration) running
over ``torch_npu_sim``: a plain-torch stand-in for the torch_npu module,
installed into ``sys.modules`` only inside the process that uses this
platform, with every tensor on the CPU. It exercises no device placement and
no real kernel; passing here is not an NPU run (docs/ascend.md).
"""

from __future__ import annotations

import importlib.util
import sys

from paged.platforms.base import Availability
from paged.platforms.npu import NpuPlatform

from paged_npu_sim import torch_npu_sim

_saved: dict = {}


def install() -> None:
    """Puts the simulator in place of torch_npu (and torch.npu) in this process."""
    import torch

    if sys.modules.get("torch_npu") is torch_npu_sim:
        return
    _saved.update(module=sys.modules.get("torch_npu"), npu=getattr(torch, "npu", None))
    sys.modules["torch_npu"] = torch_npu_sim
    torch.npu = torch_npu_sim.npu


def uninstall() -> None:
    """Restores what install() replaced (tests that run other platforms after)."""
    import torch

    if sys.modules.get("torch_npu") is not torch_npu_sim:
        return
    if _saved.get("module") is None:
        sys.modules.pop("torch_npu", None)
    else:
        sys.modules["torch_npu"] = _saved["module"]
    if _saved.get("npu") is None:
        del torch.npu
    else:
        torch.npu = _saved["npu"]


def _real_torch_npu() -> bool:
    if sys.modules.get("torch_npu") is torch_npu_sim:
        return False
    return sys.modules.get("torch_npu") is not None or importlib.util.find_spec("torch_npu") is not None


class NpuSimPlatform(NpuPlatform):
    """NpuPlatform over the simulator: detection and device count are the
    simulator's (there is no CANN to probe); everything else is inherited."""

    name = "npu-sim"
    device_type = "cpu"  # the simulator's tensors live on the CPU
    dist_backend = "gloo"
    auto_priority = 0
    # Host tensors leave the simulated torch.npu's statistics at zero: a
    # profiled step would measure nothing and cost seconds of bf16 on the CPU
    # per engine (tests/test_npu_sim.py runs the step itself once).
    profiles_memory = False

    def is_available(self) -> Availability:
        if _real_torch_npu():
            return Availability(False, "a real torch_npu is importable here: use --device npu, not the simulator")
        install()
        import torch

        problem = self.runtime_problem(torch)  # NpuPlatform's own check, on the simulator
        return Availability(problem is None, problem or "")

    def device_count(self) -> int:
        return int(self._require().npu.device_count())

    # The simulator's arithmetic runs on one host thread: its tensors are
    # small, and on a shared 2-core machine a second OpenMP thread mostly
    # spins (measured: 11.3 s vs 1.0 s of CPU for the same 24 greedy tokens).
    def init(self, rank: int = 0, **options) -> None:
        super().init(rank=rank, **options)
        self.bind_thread()

    def bind_thread(self) -> None:
        import torch

        torch.set_num_threads(1)

    def env_report(self) -> dict:
        report = super().env_report()
        report["simulated"] = "plain-torch stand-in for torch_npu on CPU tensors: not an NPU"
        return report
