"""What the CUDA and the Ascend NPU backends share, written once:
memory.py (this engine instance's share of the device: the baseline read at
start, the profiled use, the KV budget) and worker.py (the worker that sizes
the KV cache from a profiled worst-case step). Nothing here names torch.cuda
or torch_npu: each platform hands in its torch device module."""
