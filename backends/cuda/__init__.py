"""The CUDA device (the kernels are csrc_cuda/, paged._C_cuda): worker.py
(CudaWorker: profiling, KV arena, CUDA graphs via graphs.py), attention.py
(CudaBackend), metadata.py (per-step launch sizes), id_checks.py.
platforms/cuda.py is the thin Platform class."""
