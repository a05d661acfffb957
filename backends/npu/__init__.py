"""The Ascend NPU device (torch_npu / CANN operators; csrc_ascend/ holds the
ACL probe): attention.py (NpuBackend), layout.py (the operators' cache
layout and documented limits), metadata.py (per-step host lists, masks and
limit checks), operators.py (the installed release's keywords), worker.py
(NpuWorker). What the NPU shares with CUDA is backends/accelerator/;
platforms/npu.py is the thin Platform class."""
