"""Attention kernels of the CUDA backend. Decode: achieved GB/s of K/V
read, side by side with the GPU's copy bandwidth measured in the same run
(target: decode >= 60% of copy) and with the pure-torch reference backend on
the same GPU. Prefill (the tensor-core kernel): causal TFLOP/s over the paged
cache next to torch's scaled_dot_product_attention on the same shapes laid
out densely (no block table: SDPA's best case).

    python benchmarks/kernels_cuda.py [--json results.json] [--quick]

Prints a table and one JSON object (also written to --json). Without a GPU it
prints the reason and exits 0.
"""

from __future__ import annotations

import argparse
import math
import sys

import torch
from timing import emit_json


def cuda_time_ms(fn, iters: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def copy_bandwidth_gbs(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy, counting bytes read plus bytes written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = cuda_time_ms(lambda: dst.copy_(src), iters=10)
    return 2 * nbytes / (ms * 1e-3) / 1e9


def decode_case(batch, seq_len, heads, kv_heads, head_size, block_size, dtype, quick):
    from paged.backends.cuda.attention import CudaBackend
    from paged.backends.reference.attention import ReferenceBackend

    args = (heads, kv_heads, head_size, block_size, dtype, "cuda:0")
    cuda, ref = CudaBackend(*args, check_ids=False), ReferenceBackend(*args)
    blocks_per_seq = math.ceil(seq_len / block_size)
    num_blocks = batch * blocks_per_seq
    kc, vc = (torch.randn(cuda.kv_cache_shape(num_blocks), device="cuda").to(dtype) for _ in range(2))
    tables = torch.randperm(num_blocks, device="cuda").to(torch.int32).view(batch, blocks_per_seq)
    lens = torch.full((batch,), seq_len, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, heads, head_size, device="cuda").to(dtype)
    out = torch.empty_like(q)
    kernel_ms = cuda_time_ms(lambda: cuda.paged_attention(out, q, kc, vc, tables, lens, cuda.scale, 0),
                             iters=20 if quick else 100)
    ref_out = torch.empty_like(q)
    ref_ms = cuda_time_ms(lambda: ref.paged_attention(ref_out, q, kc, vc, tables, lens, ref.scale, 0),
                          iters=2 if quick else 5, warmup=1)
    max_err = float((out.float() - ref_out.float()).abs().max())
    kv_bytes = 2 * batch * seq_len * kv_heads * head_size * kc.element_size()
    return {"batch": batch, "seq_len": seq_len, "heads": heads, "kv_heads": kv_heads, "head_size": head_size,
            "block_size": block_size, "dtype": str(dtype).removeprefix("torch."),
            "kernel_ms": kernel_ms, "kernel_gbs": kv_bytes / (kernel_ms * 1e-3) / 1e9,
            "reference_ms": ref_ms, "speedup_vs_reference": ref_ms / kernel_ms, "max_abs_err_vs_reference": max_err}


def prefill_case(num_seqs, q_len, heads, kv_heads, head_size, dtype, quick, block_size=16):
    """Fresh causal prompts of q_len tokens each (no cached prefix)."""
    from paged.backends.cuda.attention import CudaBackend

    cuda = CudaBackend(heads, kv_heads, head_size, block_size, dtype, "cuda:0", check_ids=False)
    blocks_per_seq = math.ceil(q_len / block_size)
    num_blocks = num_seqs * blocks_per_seq
    kc, vc = (torch.randn(cuda.kv_cache_shape(num_blocks), device="cuda").to(dtype) for _ in range(2))
    tables = torch.randperm(num_blocks, device="cuda").to(torch.int32).view(num_seqs, blocks_per_seq)
    lens = torch.full((num_seqs,), q_len, dtype=torch.int32, device="cuda")
    qsl = torch.arange(0, (num_seqs + 1) * q_len, q_len, dtype=torch.int32, device="cuda")
    q = torch.randn(num_seqs * q_len, heads, head_size, device="cuda").to(dtype)
    out = torch.empty_like(q)
    iters = 5 if quick else 20
    # _prefill: the launch sized to the real longest query, as the model runner's metadata does
    kernel_ms = cuda_time_ms(lambda: cuda._prefill(out, q, kc, vc, qsl, lens, tables, cuda.scale, 0, q_len),
                             iters=iters)
    dq = torch.randn(num_seqs, heads, q_len, head_size, device="cuda").to(dtype)
    dk, dv = (torch.randn(num_seqs, kv_heads, q_len, head_size, device="cuda").to(dtype) for _ in range(2))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    sdpa_ms = cuda_time_ms(lambda: sdpa(dq, dk, dv, is_causal=True, enable_gqa=True), iters=iters)
    flops = 4 * num_seqs * heads * head_size * q_len * (q_len + 1) / 2  # QK^T and PV, causal half
    return {"num_seqs": num_seqs, "q_len": q_len, "heads": heads, "kv_heads": kv_heads, "head_size": head_size,
            "dtype": str(dtype).removeprefix("torch."), "kernel_ms": kernel_ms,
            "kernel_tflops": flops / (kernel_ms * 1e-3) / 1e12, "sdpa_ms": sdpa_ms,
            "sdpa_tflops": flops / (sdpa_ms * 1e-3) / 1e12}


PREFILL_CASES = [  # (num_seqs, q_len, heads, kv_heads, head_size, dtype)
    (4, 2048, 32, 8, 128, torch.bfloat16),
    (16, 512, 32, 8, 128, torch.bfloat16),
    (2, 4096, 16, 16, 64, torch.float16),
    (4, 2048, 8, 2, 256, torch.bfloat16),
    (8, 1024, 8, 2, 80, torch.bfloat16),
]

CASES = [  # (batch, seq_len, heads, kv_heads, head_size, block_size, dtype)
    (64, 2048, 32, 8, 128, 16, torch.bfloat16),
    (16, 8192, 32, 8, 128, 16, torch.bfloat16),
    (256, 1024, 32, 8, 128, 32, torch.bfloat16),
    (64, 2048, 16, 16, 64, 16, torch.float16),
    (8, 32768, 64, 8, 128, 128, torch.bfloat16),
]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--quick", action="store_true", help="fewer iterations and cases")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        result = {"skipped": "no CUDA device visible (torch.cuda.is_available() is False)"}
        print(result["skipped"])
    else:
        copy_gbs = copy_bandwidth_gbs()
        rows = []
        for case in CASES[:2] if a.quick else CASES:
            r = decode_case(*case, quick=a.quick)
            r["fraction_of_copy_bw"] = r["kernel_gbs"] / copy_gbs
            rows.append(r)
        prefill = [prefill_case(*c, quick=a.quick) for c in (PREFILL_CASES[:2] if a.quick else PREFILL_CASES)]
        result = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                  "copy_gbs": copy_gbs, "target_fraction": 0.6, "decode": rows, "prefill": prefill}
        print(f"device {result['device']}: copy bandwidth {copy_gbs:.0f} GB/s (read + write)")
        print(f"{'batch':>5} {'seq':>6} {'H/Hkv':>6} {'D':>4} {'bs':>4} {'dtype':>9} {'ms':>8} {'GB/s':>7} "
              f"{'of copy':>8} {'ref ms':>9} {'x ref':>7} {'err':>8}")
        for r in rows:
            print(f"{r['batch']:>5} {r['seq_len']:>6} {r['heads']:>3}/{r['kv_heads']:<2} {r['head_size']:>4} "
                  f"{r['block_size']:>4} {r['dtype']:>9} {r['kernel_ms']:>8.3f} {r['kernel_gbs']:>7.0f} "
                  f"{r['fraction_of_copy_bw']:>7.0%} {r['reference_ms']:>9.2f} {r['speedup_vs_reference']:>7.1f} "
                  f"{r['max_abs_err_vs_reference']:>8.1e}")
        print(f"prefill (causal, fresh prompts) {'seqs':>5} {'len':>6} {'H/Hkv':>6} {'D':>4} {'dtype':>9} "
              f"{'ms':>8} {'TFLOP/s':>8} {'SDPA ms':>8} {'SDPA TF/s':>9}")
        for r in prefill:
            print(f"{'':31} {r['num_seqs']:>5} {r['q_len']:>6} {r['heads']:>3}/{r['kv_heads']:<2} {r['head_size']:>4} "
                  f"{r['dtype']:>9} {r['kernel_ms']:>8.3f} {r['kernel_tflops']:>8.1f} {r['sdpa_ms']:>8.3f} "
                  f"{r['sdpa_tflops']:>9.1f}")
    emit_json(result, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
