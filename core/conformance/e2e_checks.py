"""End to end: the platform's attention backend is batch invariant (asserted
where the platform declares it, else measured), and greedy generation of the
default model on the platform matches the reference backend (through
paged.LLM, when the engine and model exist)."""

from __future__ import annotations

import torch

from paged.backends.reference.attention import ReferenceBackend
from paged.core.conformance.kernel_checks import measured_result
from paged.core.conformance.runner import Check, Context, Measured, Skip

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Paged attention stores the KV cache in"]


def _fill_sequences(be, seq_lens, gen, device):
    """Writes random K/V for each sequence into fresh caches; returns
    (key_cache, value_cache, block_tables)."""
    bs = be.block_size
    per_seq = [(n + bs - 1) // bs for n in seq_lens]
    num_blocks = sum(per_seq) + 1
    ((kc, vc),) = be.allocate_kv_cache(1, num_blocks)
    perm = torch.randperm(num_blocks, generator=gen).tolist()  # scattered physical blocks
    tables = torch.zeros(len(seq_lens), max(per_seq), dtype=torch.int32)
    start = 0
    for i, n in enumerate(seq_lens):
        tables[i, :per_seq[i]] = torch.tensor(perm[start:start + per_seq[i]], dtype=torch.int32)
        start += per_seq[i]
        pos = torch.arange(n)
        slots = (tables[i, pos // bs].long() * bs + pos % bs).to(device)
        k = torch.randn(n, be.num_kv_heads, be.head_size, generator=gen).to(be.dtype).to(device)
        v = torch.randn(n, be.num_kv_heads, be.head_size, generator=gen).to(be.dtype).to(device)
        be.reshape_and_cache(k, v, kc, vc, slots)
    return kc, vc, tables.to(device)


def _batch_invariance(ctx: Context):
    """Decode and prefill results of one sequence must not depend on which
    other sequences share the batch: bitwise where declared, else measured."""
    p = ctx.platform
    dev, dtype = p.torch_device(0), p.default_dtype()
    d = ctx.caps.head_size_near(64)
    be = ctx.worker.attention_backend_cls()(8, 2, d, p.default_block_size, dtype, dev)
    gen = torch.Generator().manual_seed(ctx.seed)
    bs = be.block_size
    seq_lens = [1, bs - 1, bs + 3, 3 * bs + 5] if ctx.quick else [1, 2, bs - 1, bs, bs + 3, 3 * bs + 5, 7 * bs]
    kc, vc, tables = _fill_sequences(be, seq_lens, gen, dev)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=dev)
    q = torch.randn(len(seq_lens), 8, d, generator=gen).to(dtype).to(dev)
    out = torch.empty_like(q)
    be.paged_attention(out, q, kc, vc, tables, lens, be.scale)
    worst = {"decode": 0.0, "prefill": 0.0}
    for i in range(len(seq_lens)):
        alone = torch.empty_like(q[i:i + 1])
        be.paged_attention(alone, q[i:i + 1].contiguous(), kc, vc, tables[i:i + 1].contiguous(), lens[i:i + 1], be.scale)
        worst["decode"] = max(worst["decode"], float((alone[0].float() - out[i].float()).abs().max()))
    # prefill: each sequence's last min(n, 5) positions as queries
    q_lens = [min(n, 5) for n in seq_lens]
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=dev)
    qp = torch.randn(sum(q_lens), 8, d, generator=gen).to(dtype).to(dev)
    outp = torch.empty_like(qp)
    be.prefill_attention(outp, qp, kc, vc, qsl, lens, tables, be.scale)
    for i in range(len(seq_lens)):
        a, b = int(qsl[i]), int(qsl[i + 1])
        alone = torch.empty_like(qp[a:b])
        be.prefill_attention(alone, qp[a:b].contiguous(), kc, vc,
                             torch.tensor([0, b - a], dtype=torch.int32, device=dev),
                             lens[i:i + 1], tables[i:i + 1].contiguous(), be.scale)
        worst["prefill"] = max(worst["prefill"], float((alone.float() - outp[a:b].float()).abs().max()))
    for path, diff in worst.items():
        assert diff == 0.0 or not ctx.caps.invariant(dtype, path), \
            f"{path} outputs change with the batch composition (max abs difference {diff:.3g})"
    return measured_result({k: v for k, v in worst.items() if not ctx.caps.invariant(dtype, k)})


def _llm(ctx: Context, reference: bool):
    if reference and ctx.worker.attention_backend_cls() is ReferenceBackend:
        reference = False  # the platform's own backend is the oracle: one engine serves both
    key = ("llm", reference)
    if key in ctx.cache:
        return ctx.cache[key]
    try:
        from paged import LLM
    except (ImportError, AttributeError) as e:
        raise Skip(f"engine not available in this build (paged.LLM: {e})")
    p = ctx.platform
    dtype = "float32" if torch.float32 in p.supported_dtypes() else str(p.default_dtype()).replace("torch.", "")
    # a small KV cache: three short prompts need a few blocks, and zeroing
    # a default-sized cache (GiBs) would dominate the check
    kwargs = dict(model=None, device=p.name, dtype=dtype, seed=0, kv_cache_memory="256MiB",
                  max_model_len=2048)
    if ctx.worker.linear_activations("float32") is not None:
        # packed-weight linears: their exact path, so the comparison sees the attention
        # backend alone (quantized activations turn its last bits into other codes)
        kwargs["linear_activations"] = "float32"
    if reference:
        kwargs["attention_backend"] = "reference"
    try:
        llm = LLM(**kwargs)
    except (FileNotFoundError, OSError, ConnectionError) as e:
        raise Skip(f"default model not available here: {type(e).__name__}: {e}")
    ctx.cache[key] = (llm, dtype)
    return ctx.cache[key]


def _greedy(llm, prompts, max_tokens):
    from paged import SamplingParams

    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    return [list(o.outputs[0].token_ids) for o in outs]


def _greedy_vs_reference(ctx: Context):
    n = 8 if ctx.quick else 24
    llm, dtype = _llm(ctx, reference=False)
    ref, _ = _llm(ctx, reference=True)
    if ref is llm:
        _greedy(llm, PROMPTS, n)  # generation still has to work
        return Measured(0.0, "the platform's attention backend is the reference backend: nothing to compare")
    got, want = _greedy(llm, PROMPTS, n), _greedy(ref, PROMPTS, n)
    mismatches = []
    for prompt, g, w in zip(PROMPTS, got, want):
        agree = next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), min(len(g), len(w)))
        # float32 must agree token for token; reduced precision may drift late, not early
        needed = min(len(w), len(g)) if dtype == "float32" else min(4, len(w))
        if agree < needed:
            mismatches.append(f"{prompt!r}: first difference at token {agree} ({g[:agree + 1]} vs {w[:agree + 1]})")
    assert not mismatches, f"greedy output ({dtype}) differs from the reference backend: " + "; ".join(mismatches)
    return 0.0


def _engine_batch_invariance(ctx: Context):
    """Greedy tokens alone vs batched: equal where the platform declares the
    engine path invariant in this dtype, else the share that differs."""
    llm, dtype = _llm(ctx, reference=False)
    declared = ctx.caps.invariant(getattr(torch, dtype), "engine")
    n = 8 if ctx.quick else 16
    batched = _greedy(llm, PROMPTS, n)
    differ = 0
    for prompt, b in zip(PROMPTS, batched):
        (alone,) = _greedy(llm, [prompt], n)
        assert alone == b or not declared, f"{prompt!r}: alone {alone} but in a batch {b}"
        differ += sum(x != y for x, y in zip(alone, b)) + abs(len(alone) - len(b))
    if declared:
        return 0.0
    share = differ / (n * len(PROMPTS))
    return Measured(share, f"not declared batch invariant ({dtype}); greedy tokens differing alone vs batched: "
                           f"{differ} of {n * len(PROMPTS)}")


def checks(ctx: Context) -> list[Check]:
    return [Check("e2e.kernel_batch_invariance", _batch_invariance),
            Check("e2e.greedy_vs_reference", _greedy_vs_reference),
            Check("e2e.engine_batch_invariance", _engine_batch_invariance)]
