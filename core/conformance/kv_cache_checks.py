"""Checks of a KV cache stored in another dtype than the model's
(--kv-cache-dtype: bfloat16, int8, fp8_e4m3), for every such dtype the platform
declares (``Worker.extra_kv_cache_dtypes``); a platform that stores only
the model dtype skips them with that reason.

The oracle is the reference backend with the same cache dtype: it quantizes
int8 and float8_e4m3fn rows in plain torch exactly as the kernel contract says
(backends/reference/kv_quant.py), so

- the cache a backend writes must equal the reference's bit for bit (same
  float32 operations on both sides), and read_kv must return the same values;
- writing a sequence's tokens in one call or in chunks must give the same
  bytes (the quantization of a block may not depend on how the prompt was
  chunked: a prefix-cache hit must see what a miss wrote);
- attention over the quantized cache must match the reference's within
  KV_TOLERANCE: both read the same dequantized values, so only float32
  summation order (and the output's rounding) differs;
- the quantization's own cost, attention over the int8 / fp8 cache vs over
  the unquantized one, is measured and reported (not a pass/fail bound past
  QUANT_ERROR_LIMIT, which only catches a broken scale).
"""

from __future__ import annotations

import torch

from paged.backends.reference.attention import ReferenceBackend
from paged.core.conformance import kernel_checks as kc
from paged.core.conformance.runner import Check, Context, Measured, Skip

#: max |out - ref| / max |ref| of attention over a converted cache vs the
#: reference over the same cache, by model (query / output) dtype
KV_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}
#: attention over a quantized cache vs the unquantized one (relative): a
#: correct per-row scale gives ~1e-2 (int8) / ~5e-2 (fp8_e4m3: 3 mantissa
#: bits) on random data; a wrong one, O(1)
QUANT_ERROR_LIMIT = {"int8": 0.1, "fp8_e4m3": 0.2}
#: --kv-cache-dtype names -> torch dtypes
KV_DTYPES = {"bfloat16": torch.bfloat16, "int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}

CASES = (  # (num_heads, num_kv_heads, head_size, block_size, seq_lens, query_lens)
    (4, 4, 64, 16, (1, 16, 17, 48), None),
    (9, 3, 128, 32, (300, 31, 64), None),
    (9, 3, 64, 16, (600, 90, 33), (64, 17, 1)),
    (6, 2, 64, 128, (129, 256, 2), (1, 128, 2)),
)


def _raw(t: torch.Tensor) -> torch.Tensor:
    """A cache's bytes to compare: float8 rows are compared as bytes (a scale's
    bytes read as float8 may be NaN, which equals nothing)."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _model_dtype(platform):
    dtypes = list(platform.supported_dtypes())
    return torch.float32 if torch.float32 in dtypes else dtypes[0]


def _backend(backend_cls, case: kc.AttnCase, device, dtype, kv_dtype):
    return backend_cls(case.num_heads, case.num_kv_heads, case.head_size, case.block_size, dtype, device,
                       sliding_window=case.sliding_window, kv_cache_dtype=kv_dtype)


def _cases(ctx: Context):
    out = []
    for i, (h, hkv, d, bs, lens, qlens) in enumerate(CASES[:2] if ctx.quick else CASES):
        out.append(kc.fit(kc.AttnCase(h, hkv, d, bs, lens, qlens, seed=ctx.seed + i), ctx.caps))
    return out


def _write_vs_reference(ctx: Context, kv_dtype) -> float:
    p, dtype = ctx.platform, _model_dtype(ctx.platform)
    for case in _cases(ctx):
        batch = kc.make_batch(case, dtype)
        be = _backend(ctx.worker.attention_backend_cls(), case, p.torch_device(0), dtype, kv_dtype)
        ref = _backend(ReferenceBackend, case, "cpu", dtype, kv_dtype)
        got = kc.filled_cache(be, kc._to(batch, be.device))
        want = kc.filled_cache(ref, batch)
        for name, g, w in zip(("key_cache", "value_cache"), got, want):
            if g.dtype != kv_dtype or not torch.equal(_raw(g.cpu()), _raw(w)):
                raise AssertionError(f"{name} ({g.dtype}) after reshape_and_cache differs from the reference's "
                                     f"({w.dtype}) in {int((_raw(g.cpu()) != _raw(w)).sum())} bytes, case {case}")
        for name, g, w in zip(("key", "value"), be.read_kv(*got, batch.slot_mapping.to(be.device)),
                              ref.read_kv(*want, batch.slot_mapping)):
            if not torch.equal(g.cpu(), w):
                raise AssertionError(f"read_kv {name} differs from the reference's, case {case}")
    return 0.0


def _chunking_invariant(ctx: Context, kv_dtype) -> float:
    """The batch's tokens written in one call vs in uneven chunks: same bytes."""
    p, dtype = ctx.platform, _model_dtype(ctx.platform)
    case = _cases(ctx)[-1]
    batch = kc._to(kc.make_batch(case, dtype), p.torch_device(0))
    be = _backend(ctx.worker.attention_backend_cls(), case, p.torch_device(0), dtype, kv_dtype)
    whole = kc.filled_cache(be, batch)
    kcache, vcache = be.allocate_kv_cache(1, batch.num_blocks)[0]
    cuts = [0, 1, 5, 70, 71, batch.key.shape[0]]
    for a, b in zip(cuts, cuts[1:]):
        if a < b:
            be.reshape_and_cache(batch.key[a:b], batch.value[a:b], kcache, vcache, batch.slot_mapping[a:b])
    if not (torch.equal(_raw(whole[0]), _raw(kcache)) and torch.equal(_raw(whole[1]), _raw(vcache))):
        raise AssertionError(f"the {kv_dtype} cache depends on how the tokens were chunked into writes")
    return 0.0


def _attention_vs_reference(ctx: Context, kv_dtype) -> float:
    p, dtype = ctx.platform, _model_dtype(ctx.platform)
    worst = 0.0
    for case in _cases(ctx):
        batch = kc.make_batch(case, dtype)
        ref = kc.run_attention(_backend(ReferenceBackend, case, "cpu", dtype, kv_dtype), batch, case)
        be = _backend(ctx.worker.attention_backend_cls(), case, p.torch_device(0), dtype, kv_dtype)
        out = kc.run_attention(be, kc._to(batch, be.device), case)
        err = kc._rel_error(out, ref)
        if not err <= KV_TOLERANCE[dtype]:
            raise AssertionError(f"{kv_dtype} KV cache, {dtype} queries, {case}: max relative error "
                                 f"{err:.3g} > {KV_TOLERANCE[dtype]:g} vs the reference")
        worst = max(worst, err)
    return worst


def _quantization_cost(ctx: Context, name: str) -> Measured:
    """Reference attention over the int8 / fp8 cache vs over the model-dtype cache."""
    dtype, kv = _model_dtype(ctx.platform), KV_DTYPES[name]
    worst = 0.0
    for case in _cases(ctx):
        batch = kc.make_batch(case, dtype)
        exact = kc.run_attention(_backend(ReferenceBackend, case, "cpu", dtype, None), batch, case)
        quant = kc.run_attention(_backend(ReferenceBackend, case, "cpu", dtype, kv), batch, case)
        worst = max(worst, kc._rel_error(quant, exact))
    if not worst <= QUANT_ERROR_LIMIT[name]:
        raise AssertionError(f"{name} KV attention error {worst:.3g} > {QUANT_ERROR_LIMIT[name]} "
                             "vs the unquantized cache")
    return Measured(worst, f"{name} KV vs unquantized (reference, random K/V): max relative error")


def checks(ctx: Context) -> list[Check]:
    extra = tuple(ctx.worker.extra_kv_cache_dtypes)
    names = [n for n in KV_DTYPES if n in extra]
    if not names:
        def none(_ctx):
            raise Skip("this platform stores the KV cache in the model dtype only (no --kv-cache-dtype)")
        return [Check("kv_cache", none, required=False)]
    out = []
    for name in names:
        kv = KV_DTYPES[name]
        out += [Check(f"kv_cache.{name}.write_vs_reference", lambda c, kv=kv: _write_vs_reference(c, kv)),
                Check(f"kv_cache.{name}.chunking_invariant", lambda c, kv=kv: _chunking_invariant(c, kv)),
                Check(f"kv_cache.{name}.attention_vs_reference", lambda c, kv=kv: _attention_vs_reference(c, kv))]
        if name in QUANT_ERROR_LIMIT:
            out.append(Check(f"kv_cache.{name}.quantization_cost", lambda c, n=name: _quantization_cost(c, n),
                             required=False))
    return out
