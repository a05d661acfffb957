"""The CUDA device (the kernels are csrc_cuda/, paged._C_cuda): worker.py
(CudaWorker: profiling, KV arena, CUDA graphs via graphs.py), attention.py
(CudaBackend), metadata.py (per-step launch sizes and workspace), launch.py
(the decode launch sized by the step's lengths), id_checks.py. What CUDA
shares with the NPU is backends/accelerator/; platforms/cuda.py is the thin
Platform class."""
