"""The CPU device, all of it in one place (the C++ behind it is csrc_cpu/):

- worker.py       CpuWorker: layer ops, the whole-stack runner, weight panels, precision plan
- attention.py    CpuBackend: the paged attention and cache kernels of paged._C_cpu
- quant_linear.py CpuPackedLinear: linears on packed GGUF blocks (float32 / int8 / int8x2 / mixed)
- layer_ops.py    fused elementwise layer ops (norms, RoPE, SiLU-and-mul)
- layer_stack.py  every decoder layer of a step in one C++ call
- host/           topology, CPU lists, load watching, thread-binding plans, NUMA memory, ISA levels

platforms/cpu.py is the thin Platform class (detection, memory, dtypes,
capabilities, which Worker to make).
"""
