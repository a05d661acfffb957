"""The Ascend NPU device (torch_npu / CANN operators; csrc_ascend/ holds the
ACL probe): attention.py (NpuBackend), layout.py (the operators' cache
layout), metadata.py (per-step host lists and masks). platforms/npu.py is
the thin Platform class."""
