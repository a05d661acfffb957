"""Benchmark of the CPU attention kernels against the pure-torch reference.

Decode: batch x context x dtype, reporting time per call, GB/s of K/V read,
that as a % of this machine's memory bandwidth, and the speedup over
ReferenceBackend. The bandwidth is a 1 GiB tensor copy; on a shared host it
moves by 30% within a run, so each case alternates copy and kernel for a few
rounds and %bw is the median of the rounds' ratios. The caches
are rotated over several layers whose total is far larger than the L3, so the
figures are DRAM-bound like a real model's. As a yardstick for the scattered
access, "gather GB/s" is torch.index_select copying the same K/V blocks in
block-table order (the same bytes read, plus writing them). Prefill: tokens/s
of one prompt attending to itself (512 tokens; 256 / 512 / 2048 over the
default engine's float16 cache), with the prompt-row kernels beside the
float32 one where they run: mixed-bf16's bfloat16 kernel (AMX-BF16 CPUs)
and mixed's lane-major float32 kernel (the avx512 attention build).

--kv-cache: decode attention (float32 queries, batch 32 x context 4096) over
a float32, bfloat16 and int8 KV cache (--kv-cache-dtype): time, GB/s of cache
bytes read (int8: its per-row scales included) and speedup over the float32
cache. --kv-accuracy: what the quantized caches cost on the default model:
greedy agreement with the float32-cache engine (tokens before the first
divergence, accuracy_gate.py's prompts) and the perplexity delta on
accuracy_gate.py's stdlib-docstring corpus.

    python benchmarks/attention_kernels.py [--quick] [--json PATH] [--threads N] [--block-size N]
    python benchmarks/attention_kernels.py --kv-cache [--kv-accuracy] [--quick] [--json PATH]

The block size defaults to the CPU platform's (what the engine uses).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import platform
import statistics
import time

import torch
from timing import best_time

from paged.backends.cpu.attention import CpuBackend, ops
from paged.backends.reference.attention import ReferenceBackend
from paged.platforms.cpu import CpuPlatform

ROTATE_BYTES = 768 << 20  # total cache memory cycled through (>> L3)


_copy_buffers: list[torch.Tensor] = []


def memory_bandwidth(reps: int = 4) -> float:
    """GB/s of a 1 GiB tensor copy (bytes read + bytes written), best of reps."""
    if not _copy_buffers:
        _copy_buffers.extend([torch.ones(1 << 28, dtype=torch.float32), torch.empty(1 << 28, dtype=torch.float32)])
    src, dst = _copy_buffers
    best = min(_once(lambda: dst.copy_(src)) for _ in range(reps))
    return 2 * src.numel() * 4 / best / 1e9


def _once(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def decode_case(heads, kv_heads, head, batch, context, dtype, block_size, min_time, with_reference, rounds=3,
                kv_dtype=None):
    cfg = (heads, kv_heads, head, block_size, dtype)
    cpu, ref = CpuBackend(*cfg, kv_cache_dtype=kv_dtype), ReferenceBackend(*cfg, kv_cache_dtype=kv_dtype)
    blocks_per_seq = (context + block_size - 1) // block_size
    elem = torch.empty((), dtype=cpu.kv_cache_dtype).element_size()
    row = cpu.kv_cache_shape(1)[-1]  # elements of one token's row of one kv head (int8: + its scale)
    layer_bytes = 2 * batch * blocks_per_seq * block_size * kv_heads * row * elem
    num_layers = max(2, min(64, ROTATE_BYTES // layer_bytes))
    num_blocks = batch * blocks_per_seq
    # Allocated like the engine's (the page size behind the cache matters: every
    # block of a scattered table is a TLB miss on 4 KB pages), then filled.
    caches = cpu.allocate_kv_cache(num_layers, num_blocks)
    for kc, vc in caches:
        fill_cache(kc, head)
        fill_cache(vc, head)
    tables = torch.randperm(num_blocks).to(torch.int32).reshape(batch, blocks_per_seq).contiguous()
    lens = torch.full((batch,), context, dtype=torch.int32)
    query = torch.randn(batch, heads, head).to(dtype)
    out = torch.empty_like(query)
    layer = [0]

    def run(be):
        def call():
            kc, vc = caches[layer[0] % num_layers]
            layer[0] += 1
            be.paged_attention(out, query, kc, vc, tables, lens, be.scale, 0)
        return call

    # Copy and kernel alternate, so each ratio compares the two under the
    # same load from the rest of the machine.
    copy_gbps, ratios, t_cpu = [], [], float("inf")
    kv_bytes = 2 * batch * context * kv_heads * row * elem
    for _ in range(rounds):
        copy_gbps.append(memory_bandwidth(reps=2))
        t = best_time(run(cpu), min_time / rounds)
        ratios.append(kv_bytes / t / 1e9 / copy_gbps[-1])
        t_cpu = min(t_cpu, t)
    t_ref = best_time(run(ref), min_time / 2, max_reps=20) if with_reference else float("nan")
    t_gather = gather_time(caches, tables, min_time / 2)
    return {"kind": "decode", "dtype": str(dtype).replace("torch.", ""),
            "kv_cache_dtype": str(cpu.kv_cache_dtype).replace("torch.", ""), "heads": heads, "kv_heads": kv_heads,
            "head_size": head, "batch": batch, "context": context, "block_size": block_size,
            "cpu_ms": t_cpu * 1e3, "ref_ms": t_ref * 1e3, "gbps": kv_bytes / t_cpu / 1e9,
            "gather_gbps": kv_bytes / t_gather / 1e9, "copy_gbps": statistics.median(copy_gbps),
            "pct_bw": 100 * statistics.median(ratios),
            "speedup": t_ref / t_cpu, "layers_rotated": num_layers}


def fill_cache(cache, head):
    """Random K or V: normal floats, or int8 / fp8 rows with a valid scale."""
    if cache.dtype not in (torch.int8, torch.float8_e4m3fn):
        cache.normal_()
        return
    raw = cache.view(torch.uint8) if cache.dtype == torch.float8_e4m3fn else cache
    if cache.dtype == torch.int8:
        cache[..., :head].random_(-127, 128)
    else:
        raw[..., :head] = (torch.randn(raw[..., :head].shape) * 100).to(torch.float8_e4m3fn).view(torch.uint8)
    raw[..., head:] = torch.tensor([0.02], dtype=torch.float32).view(raw.dtype)


def gather_time(caches, tables, min_time) -> float:
    """Best seconds to copy one layer's K and V blocks in block-table order
    with torch.index_select into preallocated buffers."""
    idx = tables.flatten().long()
    kbuf = caches[0][0].new_empty((idx.numel(),) + caches[0][0].shape[1:])
    vbuf = torch.empty_like(kbuf)
    layer = [0]

    def call():
        kc, vc = caches[layer[0] % len(caches)]
        layer[0] += 1
        torch.index_select(kc, 0, idx, out=kbuf)
        torch.index_select(vc, 0, idx, out=vbuf)
    return best_time(call, min_time, max_reps=50)


# The prompt-row kernels beside the shared float32 one: name -> (whether it
# reads this cache here, the backend method). bf16: mixed-bf16's (AMX-BF16
# CPUs); lanes: mixed's lane-major float32 kernel (the avx512 attention build).
PROMPT_KERNELS = {"bf16": ("bf16_prompt_attention_reads", "prefill_attention_bf16"),
                  "lanes": ("lanes_prompt_attention_reads", "prefill_attention_lanes")}


def prefill_case(heads, kv_heads, head, tokens, dtype, block_size, min_time, cache_dtype=None):
    """One prompt of `tokens` attending to itself: the float32 kernel, the
    prompt-row kernels that run here over this cache (PROMPT_KERNELS; None
    where one does not) and the reference, `cache_dtype` (default: dtype) in
    the cache."""
    cache_dtype = cache_dtype or dtype
    cfg = (heads, kv_heads, head, block_size, dtype)
    nb = (tokens + block_size - 1) // block_size
    table = torch.arange(nb, dtype=torch.int32)[None].contiguous()
    lens = torch.tensor([tokens], dtype=torch.int32)
    qsl = torch.tensor([0, tokens], dtype=torch.int32)
    query = torch.randn(tokens, heads, head).to(dtype)
    out = torch.empty_like(query)
    kc = torch.randn(nb, kv_heads, block_size, head).to(cache_dtype)
    vc = torch.randn_like(kc)
    cpu, ref = CpuBackend(*cfg, kv_cache_dtype=cache_dtype), ReferenceBackend(*cfg, kv_cache_dtype=cache_dtype)
    args = (out, query, kc, vc, qsl, lens, table, cpu.scale, 0)
    calls = {"cpu": functools.partial(cpu.prefill_attention, *args),
             "reference": functools.partial(ref.prefill_attention, out, query, kc, vc, qsl, lens, table, ref.scale, 0)}
    for name, (reads, method) in PROMPT_KERNELS.items():
        if getattr(ops(), reads)(kc):
            calls[name] = functools.partial(getattr(cpu, method), *args)
    res = {name: best_time(fn, min_time, max_reps=20) for name, fn in calls.items()}
    row = {"kind": "prefill", "dtype": str(dtype).replace("torch.", ""),
           "cache_dtype": str(cache_dtype).replace("torch.", ""), "heads": heads, "kv_heads": kv_heads,
           "head_size": head, "tokens": tokens, "block_size": block_size,
           "cpu_ms": res["cpu"] * 1e3, "ref_ms": res["reference"] * 1e3,
           "cpu_tok_s": tokens / res["cpu"], "ref_tok_s": tokens / res["reference"],
           "speedup": res["reference"] / res["cpu"]}
    for name in PROMPT_KERNELS:
        t = res.get(name)
        row[f"{name}_ms"] = None if t is None else t * 1e3
        row[f"{name}_tok_s"] = None if t is None else tokens / t
        row[f"{name}_vs_cpu"] = None if t is None else res["cpu"] / t
    return row


def kv_cache_main(args, min_time) -> dict:
    """Decode over each KV cache dtype at batch 32 x context 4096, float32 queries."""
    print(f"\n{'KV cache':13} {'H/Hkv/D':10} {'batch':>5} {'ctx':>5} {'cpu ms':>8} {'GB/s':>6} {'%bw':>5} "
          f"{'x f32 KV':>8} {'KV MiB':>7}")
    rows = []
    for h, hkv, d in ((9, 3, 64), (16, 2, 128)):
        base = None
        for kv in (torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.float8_e4m3fn):
            r = decode_case(h, hkv, d, 32, 4096, torch.float32, args.block_size, min_time, with_reference=False,
                            kv_dtype=kv)
            base = base or r["cpu_ms"]
            r["speedup_vs_f32_kv"] = base / r["cpu_ms"]
            rows.append(r)
            mib = r["gbps"] * r["cpu_ms"] / 1e3 * 1e9 / 2**20
            print(f"{r['kv_cache_dtype']:13} {f'{h}/{hkv}/{d}':10} {32:>5} {4096:>5} {r['cpu_ms']:8.3f} "
                  f"{r['gbps']:6.1f} {r['pct_bw']:5.0f} {r['speedup_vs_f32_kv']:8.2f} {mib:7.1f}")
    out = {"decode": rows}
    if args.kv_accuracy:
        out["accuracy"] = kv_accuracy(args.quick)
    return out


def kv_accuracy(quick: bool) -> dict:
    """Greedy agreement with the float32 KV cache and perplexity delta, on
    the default model, through accuracy_gate.py's prompts, corpus and runner."""
    import accuracy_gate as gate

    from paged.core.models.loaders import load_model_files
    from paged.core.models.files import resolve_model

    model_path = str(resolve_model(None, quiet=True))
    tok = load_model_files(model_path, torch.float32, quiet=True, keep_packed=True).tokenizer
    prompts = [tok.encode(p) for p in gate.PROMPTS]
    new_tokens, ppl_tokens, window = (16, 2048, 512) if quick else (32, 8192, 512)
    corpus = tok.encode(gate.stdlib_docstrings())[:ppl_tokens]
    windows = [w for w in (corpus[i:i + window] for i in range(0, len(corpus) - 1, window)) if len(w) > 1]
    rows = {}
    for kv in ("auto", "bfloat16", "float16", "int8", "fp8_e4m3"):
        outs, ppl = gate.paged_greedy_and_ppl(model_path, dict(dtype="float32", kv_cache_dtype=kv), prompts,
                                              new_tokens, windows)
        rows[kv] = {"outs": outs, "ppl": ppl}
    base = rows["auto"]
    print(f"\n{len(prompts)} prompts x {new_tokens} greedy tokens vs the float32 KV cache (default model, "
          f"--dtype float32); perplexity over {sum(len(w) for w in windows)} tokens of stdlib docstrings")
    print(f"{'KV cache':10}{'agree':>7}{'same tokens':>13}{'ppl':>10}{'ppl vs f32 KV':>15}")
    result = {"max_agree": len(prompts) * new_tokens}
    for kv, r in rows.items():
        agree = gate.agreement(r["outs"], base["outs"])
        same = sum(a == b for x, y in zip(r["outs"], base["outs"]) for a, b in zip(x, y))
        rel = r["ppl"] / base["ppl"] - 1
        name = "float32" if kv == "auto" else kv
        result[name] = {"agree": agree, "same_tokens": same, "ppl": r["ppl"], "ppl_vs_f32_kv": rel}
        print(f"{name:10}{agree:>7}{same:>13}{r['ppl']:10.4f}{rel:>+15.4%}")
    assert math.isfinite(base["ppl"])
    return result


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer cases, shorter timing")
    ap.add_argument("--json", metavar="PATH", help="write the results as JSON")
    ap.add_argument("--threads", type=int, default=0, help="torch/OpenMP threads (default: torch's)")
    ap.add_argument("--block-size", type=int, default=CpuPlatform.default_block_size,
                    help="KV block size in tokens (default: the CPU platform's, %(default)s)")
    ap.add_argument("--kv-cache", action="store_true",
                    help="only decode over float32 / bfloat16 / float16 / int8 / fp8_e4m3 KV caches (batch 32 x context 4096)")
    ap.add_argument("--kv-accuracy", action="store_true",
                    help="with --kv-cache: greedy agreement and perplexity delta on the default model")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    min_time = 0.15 if args.quick else 0.5
    bw = memory_bandwidth()
    print(f"# {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
          f"kernel ISA {ops().attention_isa()}, block size {args.block_size}, memory copy bandwidth {bw:.1f} GB/s "
          "(shared machine: expect noise; %bw: median ratio over copy/kernel rounds)")
    if args.kv_cache:
        out = kv_cache_main(args, min_time)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"memory_bandwidth_gbps": bw, "threads": torch.get_num_threads(),
                           "isa": ops().attention_isa(), **out}, f, indent=1)
        return out
    batches, contexts = ((1, 32), (128, 4096)) if args.quick else ((1, 8, 32), (128, 1024, 4096))
    shapes = [(9, 3, 64)]
    results = []
    hdr = (f"{'dtype':9} {'H/Hkv/D':10} {'batch':>5} {'ctx':>5} {'cpu ms':>8} {'ref ms':>8} {'GB/s':>6} {'%bw':>5} "
           f"{'x ref':>6} {'gather GB/s':>11} {'copy GB/s':>9}")
    print(hdr)
    for dtype in (torch.bfloat16, torch.float32):
        cases = [(s, b, c) for s in shapes for b in batches for c in contexts]
        cases.append(((16, 2, 128), 32, 4096))  # head-128 case
        for (h, hkv, d), b, c in cases:
            r = decode_case(h, hkv, d, b, c, dtype, args.block_size, min_time, with_reference=True)
            results.append(r)
            print(f"{r['dtype']:9} {f'{h}/{hkv}/{d}':10} {b:>5} {c:>5} {r['cpu_ms']:8.3f} {r['ref_ms']:8.2f} "
                  f"{r['gbps']:6.1f} {r['pct_bw']:5.0f} {r['speedup']:6.1f} {r['gather_gbps']:11.1f} {r['copy_gbps']:9.1f}")
    print(f"\n{'prefill':9} {'cache':9} {'H/Hkv/D':10} {'tokens':>6} {'cpu tok/s':>10} {'ref tok/s':>10} {'x ref':>6} "
          + " ".join(f"{name + ' tok/s':>11} {name + ' x cpu':>10}" for name in PROMPT_KERNELS))
    # prompt kernels: PROMPT_KERNELS; float32 / float16: the default engine's
    for dtype, cache, tokens in ((torch.bfloat16, None, 512), (torch.float32, None, 512),
                                 (torch.float32, torch.float16, 256), (torch.float32, torch.float16, 512),
                                 (torch.float32, torch.float16, 2048)):
        r = prefill_case(9, 3, 64, tokens, dtype, args.block_size, min_time, cache)
        results.append(r)
        extra = " ".join(f"{'-':>11} {'-':>10}" if r[f"{n}_tok_s"] is None
                         else f"{r[f'{n}_tok_s']:11.0f} {r[f'{n}_vs_cpu']:10.2f}" for n in PROMPT_KERNELS)
        print(f"{r['dtype']:9} {r['cache_dtype']:9} {'9/3/64':10} {tokens:>6} {r['cpu_tok_s']:10.0f} "
              f"{r['ref_tok_s']:10.0f} {r['speedup']:6.1f} {extra}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"memory_bandwidth_gbps": bw, "threads": torch.get_num_threads(),
                       "isa": ops().attention_isa(), "results": results}, f, indent=1)
    return results


if __name__ == "__main__":
    main()
