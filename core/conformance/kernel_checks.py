"""Kernel checks: any AttentionBackend against the pure-torch ReferenceBackend.

Every check is a plain function taking the backend class, a device and a
dtype; it returns the largest error it saw (relative to max |reference|) and
raises AssertionError with the details when something is wrong. The
conformance suite runs them for any platform; tests/test_kernels.py runs them
for the CPU backend (with hypothesis generating extra cases).

Each backend allocates and fills its own cache through its own
reshape_and_cache, so the KV layout stays the backend's choice.

``caps`` (a platform's Capabilities, platforms/capabilities.py; None = it
accepts everything and guarantees invariance everywhere) adapts every case
to sizes the platform declares (``fit``), and says where batch invariance is
asserted bitwise and where the difference is only measured and returned.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass

import torch

from paged.backends.reference.attention import ReferenceBackend
from paged.platforms.capabilities import Capabilities

#: accepts every size and guarantees invariance: the checks' cases unchanged
ANY = Capabilities(dtypes=(torch.float32, torch.bfloat16, torch.float16))

#: allowed max |out - ref| / max |ref| per dtype
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}


@dataclass(frozen=True)
class AttnCase:
    """One batch: sequence i has seq_lens[i] tokens in the cache, and its last
    query_lens[i] positions are queried (None = decode: one query each)."""

    num_heads: int
    num_kv_heads: int
    head_size: int
    block_size: int
    seq_lens: tuple[int, ...]
    query_lens: tuple[int, ...] | None = None
    sliding_window: int = 0
    spare_blocks: int = 3  # unused blocks in the pool, so ids are not dense
    table_pad: int = 1  # extra table columns past the longest sequence (padding entries = -1)
    pad_slots: int = 2  # padding tokens (slot -1) mixed into the cache write
    seed: int = 0

    @property
    def decode(self) -> bool:
        return self.query_lens is None


# --------------------------------------------------------------------------
# building inputs


def fit(case: AttnCase, caps: Capabilities | None) -> AttnCase:
    """``case`` on the nearest block and head sizes ``caps`` accepts."""
    caps = caps or ANY
    return dataclasses.replace(case, block_size=caps.block_size_near(case.block_size),
                               head_size=caps.head_size_near(case.head_size))


def _blocks_needed(n: int, bs: int) -> int:
    return (n + bs - 1) // bs


def make_backend(backend_cls, case: AttnCase, device, dtype):
    return backend_cls(case.num_heads, case.num_kv_heads, case.head_size, case.block_size, dtype,
                       device, sliding_window=case.sliding_window)


@dataclass
class Batch:
    """Device-independent inputs of one case (generated on the CPU, seeded)."""

    key: torch.Tensor  # [T, Hkv, D] all tokens of all sequences + padding rows
    value: torch.Tensor
    slot_mapping: torch.Tensor  # int64 [T]
    block_tables: torch.Tensor  # int32 [S, W]
    seq_lens: torch.Tensor  # int32 [S]
    query: torch.Tensor  # [Tq, H, D]
    query_start_loc: torch.Tensor  # int32 [S + 1]
    num_blocks: int


def make_batch(case: AttnCase, dtype) -> Batch:
    g = torch.Generator().manual_seed(case.seed)
    rng = random.Random(case.seed)
    bs, lens = case.block_size, list(case.seq_lens)
    used = [_blocks_needed(n, bs) for n in lens]
    num_blocks = sum(used) + case.spare_blocks
    perm = torch.randperm(num_blocks, generator=g).tolist()
    width = max(used) + case.table_pad
    tables = torch.full((len(lens), width), -1, dtype=torch.int32)
    slots, at = [], 0
    for i, n in enumerate(lens):
        ids = perm[at:at + used[i]]
        at += used[i]
        tables[i, :used[i]] = torch.tensor(ids, dtype=torch.int32)
        slots += [ids[p // bs] * bs + p % bs for p in range(n)]
    for _ in range(case.pad_slots):
        slots.insert(rng.randrange(len(slots) + 1), -1)
    t, hkv, d = len(slots), case.num_kv_heads, case.head_size
    qlens = [1] * len(lens) if case.decode else list(case.query_lens)
    starts = [0]
    for q in qlens:
        starts.append(starts[-1] + q)
    return Batch(
        key=torch.randn(t, hkv, d, generator=g).to(dtype),
        value=torch.randn(t, hkv, d, generator=g).to(dtype),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_tables=tables,
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        query=torch.randn(starts[-1], case.num_heads, d, generator=g).to(dtype),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        num_blocks=num_blocks,
    )


def _to(batch: Batch, device) -> Batch:
    return Batch(**{f.name: (getattr(batch, f.name).to(device) if isinstance(getattr(batch, f.name), torch.Tensor)
                             else getattr(batch, f.name)) for f in dataclasses.fields(batch)})


def filled_cache(backend, batch: Batch):
    key_cache, value_cache = backend.allocate_kv_cache(1, batch.num_blocks)[0]
    backend.reshape_and_cache(batch.key, batch.value, key_cache, value_cache, batch.slot_mapping)
    return key_cache, value_cache


def run_attention(backend, batch: Batch, case: AttnCase, kv=None, rows=None) -> torch.Tensor:
    """Attention output of `batch` (or only the sequences in `rows`) on `backend`."""
    key_cache, value_cache = kv if kv is not None else filled_cache(backend, batch)
    tables, lens, query, starts = batch.block_tables, batch.seq_lens, batch.query, batch.query_start_loc
    if rows is not None:  # a sub-batch: same cache, selected sequences
        qsl = starts.cpu().tolist()
        tables, lens = tables[rows].contiguous(), lens[rows].contiguous()
        query = torch.cat([batch.query[qsl[r]:qsl[r + 1]] for r in rows]).contiguous()
        counts = torch.tensor([0] + [qsl[r + 1] - qsl[r] for r in rows])
        starts = torch.cumsum(counts, 0).to(torch.int32).to(batch.query.device)
    out = torch.empty_like(query)
    if case.decode:
        backend.paged_attention(out, query, key_cache, value_cache, tables, lens, backend.scale,
                                case.sliding_window)
    else:
        backend.prefill_attention(out, query, key_cache, value_cache, starts, lens, tables, backend.scale,
                                  case.sliding_window)
    return out


def _rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    ref32, out32 = ref.float().cpu(), out.float().cpu()
    if not torch.isfinite(out32).all():
        return float("inf")
    return float((out32 - ref32).abs().max() / ref32.abs().max().clamp(min=1e-6)) if ref.numel() else 0.0


# --------------------------------------------------------------------------
# checks


def compare_case(backend_cls, device, dtype, case: AttnCase, caps: Capabilities | None = None) -> float:
    """One case (fitted to ``caps``) against the reference (computed on the CPU)."""
    case = fit(case, caps)
    batch = make_batch(case, dtype)
    ref = run_attention(make_backend(ReferenceBackend, case, "cpu", dtype), batch, case)
    out = run_attention(make_backend(backend_cls, case, device, dtype), _to(batch, device), case)
    err = _rel_error(out, ref)
    tol = TOLERANCE[dtype]
    if not err <= tol:
        raise AssertionError(f"{backend_cls.__name__} {dtype} {case}: max relative error {err:.3g} > {tol:g}")
    return err


def edge_cases(seed: int = 0, caps: Capabilities | None = None) -> list[AttnCase]:
    """The cases the contract is most likely to get wrong (block-relative
    lengths on each distinct block size ``caps`` gives for 16, 32, 128)."""
    c = []
    for bs in sorted({(caps or ANY).block_size_near(b) for b in (16, 32, 128)}):
        c.append(AttnCase(4, 4, 64, bs, (1, bs, bs + 1, 3 * bs), seed=seed))  # len 1, full block, new block
    c.append(AttnCase(9, 3, 64, 16, (2048, 5), table_pad=0, seed=seed))  # max context: table exactly full
    for ratio in (1, 3, 8):
        c.append(AttnCase(2 * ratio, 2, 128, 16, (300, 31, 64), seed=seed))  # GQA ratios
    c.append(AttnCase(8, 1, 64, 16, (700,), seed=seed))  # MQA
    c.append(AttnCase(4, 2, 64, 16, (100, 7, 600), sliding_window=32, seed=seed))  # window < len
    c.append(AttnCase(4, 2, 64, 16, (100, 600), sliding_window=1, seed=seed))  # window 1: only itself
    c.append(AttnCase(4, 2, 64, 16, (50,), sliding_window=4096, seed=seed))  # window > len
    c.append(AttnCase(4, 2, 64, 64, (20, 40), pad_slots=40, seed=seed))  # many padding slots
    # prefill: plain, chunked over a cached prefix, single-token chunks, window, mixed
    c.append(AttnCase(9, 3, 64, 16, (37, 16, 1), query_lens=(37, 16, 1), seed=seed))
    c.append(AttnCase(9, 3, 64, 16, (600, 90, 33), query_lens=(64, 17, 1), seed=seed))
    c.append(AttnCase(4, 1, 128, 32, (520, 300), query_lens=(520, 45), sliding_window=100, seed=seed))
    c.append(AttnCase(6, 2, 64, 128, (129, 256, 2), query_lens=(1, 128, 2), seed=seed))
    return [fit(x, caps) for x in c]


def random_case(rng: random.Random, prefill: bool, max_context: int = 1200,
                head_size: int | None = None, block_size: int | None = None) -> AttnCase:
    hkv = rng.choice((1, 2, 3))
    ratio = rng.choice((1, 2, 3, 8))
    bs = block_size or rng.choice((16, 32, 64, 128))
    lens = tuple(rng.randint(1, max_context) for _ in range(rng.randint(1, 4)))
    qlens = tuple(rng.randint(1, n) for n in lens) if prefill else None
    return AttnCase(hkv * ratio, hkv, head_size or rng.choice((64, 128)), bs, lens, qlens,
                    sliding_window=rng.choice((0, 0, rng.randint(1, max_context))),
                    spare_blocks=rng.randint(0, 4), seed=rng.randrange(2**31))


def check_random_attention(backend_cls, device, dtype, head_size: int | None = None,
                           block_size: int | None = None, quick: bool = False, seed: int = 0,
                           caps: Capabilities | None = None) -> float:
    """Seeded random batches (decode and prefill alternately)."""
    rng = random.Random(seed)
    cases = [random_case(rng, i % 2 == 1, 600 if quick else 1200, head_size, block_size)
             for i in range(2 if quick else 6)]
    return max(compare_case(backend_cls, device, dtype, c, caps) for c in cases)


def check_edge_cases(backend_cls, device, dtype, quick: bool = False, seed: int = 0,
                     caps: Capabilities | None = None) -> float:
    """The fixed edge cases of edge_cases() (every other one when quick)."""
    cases = edge_cases(seed, caps)
    return max(compare_case(backend_cls, device, dtype, c, caps) for c in (cases[::2] if quick else cases))


def check_cache_roundtrip(backend_cls, device, dtype, seed: int = 0, caps: Capabilities | None = None) -> float:
    """reshape_and_cache then read_kv returns exactly what was written;
    padding slots write nothing and read as zeros."""
    case = fit(AttnCase(6, 3, 64, 16, (40, 17, 1), pad_slots=5, seed=seed), caps)
    be = make_backend(backend_cls, case, device, dtype)
    batch = _to(make_batch(case, dtype), device)
    kc, vc = filled_cache(be, batch)
    k, v = be.read_kv(kc, vc, batch.slot_mapping)
    keep = (batch.slot_mapping >= 0).cpu()
    for name, got, want in (("key", k, batch.key), ("value", v, batch.value)):
        got, want = got.cpu(), want.cpu()
        if not torch.equal(got[keep], want[keep]):
            raise AssertionError(f"read_kv {name} differs from what reshape_and_cache wrote ({dtype})")
        if bool(got[~keep].any()):
            raise AssertionError(f"read_kv {name} of padding slots is not zero ({dtype})")
    # nothing else was touched: the zero-initialised cache holds exactly the written values
    written = int((kc != 0).sum())
    expect = int((batch.key[keep.to(batch.key.device)] != 0).sum())
    if written != expect:
        raise AssertionError(f"reshape_and_cache left {written} non-zero key values, expected {expect}")
    return 0.0


def check_copy_and_swap(backend_cls, device, dtype, seed: int = 0, caps: Capabilities | None = None) -> float:
    """copy_blocks over all layers and swap_blocks to/from a host tensor match
    the reference exactly (they move bytes)."""
    case = fit(AttnCase(4, 2, 64, 16, (64, 30), spare_blocks=6, seed=seed), caps)
    be = make_backend(backend_cls, case, device, dtype)
    batch = _to(make_batch(case, dtype), device)
    layers = [filled_cache(be, batch) for _ in range(2)]
    g = torch.Generator().manual_seed(seed)
    for kc, vc in layers[1:]:  # give layer 1 different content than layer 0
        kc.copy_(torch.randn(kc.shape, generator=g).to(dtype))
        vc.copy_(torch.randn(vc.shape, generator=g).to(dtype))
    before = [(k.cpu().clone(), v.cpu().clone()) for k, v in layers]
    n = batch.num_blocks
    mapping = torch.tensor([[0, n - 1], [2, n - 2], [2, 1]], dtype=torch.int64)
    be.copy_blocks([k for k, _ in layers], [v for _, v in layers], mapping.to(device))
    for (k, v), (k0, v0) in zip(layers, before):
        for got, old in ((k.cpu(), k0), (v.cpu(), v0)):
            want = old.clone()
            want[mapping[:, 1]] = old[mapping[:, 0]]
            if not torch.equal(got, want):
                raise AssertionError(f"copy_blocks result differs from block-wise copy ({dtype})")
    # device <-> host swap and back
    host = torch.zeros((4, *layers[0][0].shape[1:]), dtype=dtype)
    out_map = torch.tensor([[3, 0], [1, 2]], dtype=torch.int64)
    be.swap_blocks(layers[0][0], host, out_map)
    if not torch.equal(host[out_map[:, 1]], layers[0][0].cpu()[out_map[:, 0]]) or bool(host[[1, 3]].any()):
        raise AssertionError(f"swap_blocks to host wrote the wrong blocks ({dtype})")
    back = torch.zeros_like(layers[0][0])
    in_map = torch.tensor([[0, 5], [2, 4]], dtype=torch.int64)
    be.swap_blocks(host, back, in_map)
    if not torch.equal(back.cpu()[in_map[:, 1]], host[in_map[:, 0]]):
        raise AssertionError(f"swap_blocks from host wrote the wrong blocks ({dtype})")
    return 0.0


def check_batch_invariance(backend_cls, device, dtype, thread_counts=(1, 2), seed: int = 0,
                           caps: Capabilities | None = None):
    """A sequence's output is the same alone or in a batch, in any batch
    order, under any torch/OpenMP thread count and (prefill) when its query
    rows are split into chunks as chunked prefill runs them: bitwise where ``caps``
    declares the path (decode / prefill) invariant; elsewhere the largest
    difference is measured and returned as a Measured."""
    caps = caps or ANY
    # large enough that a CPU backend really runs the batch multi-threaded,
    # while the sequences alone may run on one thread
    cases = [fit(c, caps) for c in (
        AttnCase(9, 3, 64, 16, (3000, 3, 700, 260, 1200), seed=seed),
        AttnCase(9, 3, 64, 16, (900, 40, 300), query_lens=(70, 40, 1), seed=seed),
        AttnCase(8, 2, 128, 32, (3000, 513, 1500), sliding_window=300, seed=seed))]
    measured: dict[str, float] = {}
    saved = torch.get_num_threads()
    try:
        for case in cases:
            path = "decode" if case.decode else "prefill"
            for what, diff in _invariance_diffs(backend_cls, device, dtype, case, thread_counts):
                if caps.invariant(dtype, path) and diff != 0:
                    raise AssertionError(f"{what} ({dtype}, {case})")
                if not caps.invariant(dtype, path):
                    measured[path] = max(measured.get(path, 0.0), diff)
    finally:
        torch.set_num_threads(saved)
    return measured_result(measured)


def measured_result(measured: dict[str, float]):
    """0.0 when every path was asserted, else a Measured naming the paths."""
    from paged.core.conformance.runner import Measured

    if not measured:
        return 0.0
    parts = ", ".join(f"{p} {d:.3g}" for p, d in measured.items())
    return Measured(max(measured.values()), f"not declared batch invariant; measured max abs difference: {parts}")


def _invariance_diffs(backend_cls, device, dtype, case: AttnCase, thread_counts):
    """(what differed, max abs difference) for each comparison of one case."""
    be = make_backend(backend_cls, case, device, dtype)
    batch = _to(make_batch(case, dtype), device)
    kv = filled_cache(be, batch)
    torch.set_num_threads(thread_counts[0])
    full = run_attention(be, batch, case, kv)
    qsl = batch.query_start_loc.cpu().tolist()
    for r in range(len(case.seq_lens)):
        alone = run_attention(be, batch, case, kv, rows=[r])
        yield f"sequence {r} alone differs from in-batch", _max_diff(alone, full[qsl[r]:qsl[r + 1]])
    rev = list(reversed(range(len(case.seq_lens))))
    shuffled = run_attention(be, batch, case, kv, rows=rev)
    at = 0
    for r in rev:
        n = qsl[r + 1] - qsl[r]
        yield (f"sequence {r} differs when the batch order changes",
               _max_diff(shuffled[at:at + n], full[qsl[r]:qsl[r + 1]]))
        at += n
    if not case.decode:  # chunked prefill: rows of a chunk that ends early, over the keys cached so far
        for r in range(len(case.seq_lens)):
            q = qsl[r + 1] - qsl[r]
            for c0, c1 in _chunks(q):
                part = _run_chunk(be, batch, case, kv, r, c0, c1)
                yield (f"sequence {r}: query rows {c0}..{c1 - 1} differ when computed as a chunk ending there",
                       _max_diff(part, full[qsl[r] + c0:qsl[r] + c1]))
    for t in thread_counts[1:]:
        torch.set_num_threads(t)
        yield (f"output differs between {thread_counts[0]} and {t} threads",
               _max_diff(run_attention(be, batch, case, kv), full))


def _chunks(q: int) -> list[tuple[int, int]]:
    """Some [c0, c1) chunks of a q-row query: short ones at the start, in
    the middle and at the end (a 1-3 key tail is where SIMD reductions
    differ), and a half."""
    spans = {(0, 1), (0, min(q, 2)), (1, min(q, 3)), (q // 2, q // 2 + 1), (max(0, q - 3), q - 1), (0, q // 2)}
    return sorted((c0, c1) for c0, c1 in spans if 0 <= c0 < c1 <= q)


def _run_chunk(backend, batch: Batch, case: AttnCase, kv, r: int, c0: int, c1: int) -> torch.Tensor:
    """Prefill attention of query rows [c0, c1) of sequence r alone, as a
    chunked prefill runs them: the sequence's cached length ends at row c1."""
    qsl = batch.query_start_loc.cpu().tolist()
    q = qsl[r + 1] - qsl[r]
    query = batch.query[qsl[r] + c0:qsl[r] + c1].contiguous()
    length = int(batch.seq_lens[r]) - q + c1
    dev = batch.query.device
    out = torch.empty_like(query)
    backend.prefill_attention(out, query, kv[0], kv[1], torch.tensor([0, c1 - c0], dtype=torch.int32, device=dev),
                              torch.tensor([length], dtype=torch.int32, device=dev),
                              batch.block_tables[r:r + 1].contiguous(), backend.scale, case.sliding_window)
    return out


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if torch.equal(a, b):
        return 0.0
    return float((a.float() - b.float()).abs().max().cpu()) if a.numel() else 0.0


def _bad_calls(be, batch: Batch, kv, device, dtype):
    """(what, expected word in the message, callable) for each bad argument."""
    kc, vc = kv
    q, lens, tables, qsl = batch.query, batch.seq_lens, batch.block_tables, batch.query_start_loc
    out = torch.empty_like(q)
    s = be.scale

    def dec(**kw):
        a = dict(out=out, query=q, key_cache=kc, value_cache=vc, block_tables=tables, seq_lens=lens)
        a.update(kw)
        return lambda: be.paged_attention(a["out"], a["query"], a["key_cache"], a["value_cache"],
                                          a["block_tables"], a["seq_lens"], s)

    bad_table = tables.clone()
    bad_table[0, 0] = batch.num_blocks
    long_lens = lens.clone()
    long_lens[0] = tables.shape[1] * be.block_size + 1
    zero_lens = lens.clone()
    zero_lens[-1] = 0
    q_t = q.transpose(0, 1).contiguous().transpose(0, 1)  # same values, non-contiguous
    bad_qsl = qsl.clone()
    bad_qsl[-1] += 1
    bad_slots = batch.slot_mapping.clone()
    bad_slots[0] = kc.shape[0] * be.block_size
    return [
        ("query dtype float64", "query", dec(query=q.double(), out=out.double())),
        ("query head size", "query", dec(query=q[..., :16].contiguous())),
        ("query not contiguous", "contiguous", dec(query=q_t)),
        ("block id >= num_blocks", "block_tables", dec(block_tables=bad_table)),
        ("seq_len beyond table capacity", "seq_lens", dec(seq_lens=long_lens)),
        ("seq_len 0", "seq_lens", dec(seq_lens=zero_lens)),
        ("mismatched batch sizes", "seq_lens", dec(seq_lens=lens[:-1].contiguous())),
        ("block_tables int64", "block_tables", dec(block_tables=tables.long())),
        ("key_cache wrong shape", "cache", dec(key_cache=kc[:, :, :1].contiguous())),
        ("prefill query_start_loc end", "query_start_loc",
         lambda: be.prefill_attention(out, q, kc, vc, bad_qsl, lens, tables, s)),
        ("slot beyond the cache", "slot_mapping",
         lambda: be.reshape_and_cache(batch.key, batch.value, kc, vc, bad_slots)),
        ("slot_mapping int32", "slot_mapping",
         lambda: be.reshape_and_cache(batch.key, batch.value, kc, vc, batch.slot_mapping.int())),
        ("copy_blocks id out of range", "block_mapping",
         lambda: be.copy_blocks([kc], [vc], torch.tensor([[0, batch.num_blocks]], device=device))),
        ("swap_blocks shapes differ", "dst_cache",
         lambda: be.swap_blocks(kc, torch.zeros(2, 3, dtype=dtype), torch.tensor([[0, 0]]))),
    ]


def check_argument_errors(backend_cls, device, dtype, seed: int = 0, caps: Capabilities | None = None) -> float:
    """Each bad argument raises ValueError / IndexError / TypeError whose
    message names it, and leaves the process alive."""
    case = fit(AttnCase(4, 2, 64, 16, (20, 33), seed=seed), caps)
    be = make_backend(backend_cls, case, device, dtype)
    batch = _to(make_batch(case, dtype), device)
    kv = filled_cache(be, batch)
    failures = []
    for what, word, call in _bad_calls(be, batch, kv, device, dtype):
        try:
            call()
        except (ValueError, IndexError, TypeError) as e:
            if word not in str(e):
                failures.append(f"{what}: message does not name {word!r}: {e}")
        else:
            failures.append(f"{what}: no error raised")
    if failures:
        raise AssertionError(f"{backend_cls.__name__} argument checks:\n  " + "\n  ".join(failures))
    return 0.0


#: every check, for the conformance runner: name -> function(backend_cls, device, dtype)
ALL_CHECKS = {
    "cache_roundtrip": check_cache_roundtrip,
    "copy_and_swap": check_copy_and_swap,
    "edge_cases": check_edge_cases,
    "random_attention": check_random_attention,
    "batch_invariance": check_batch_invariance,
    "argument_errors": check_argument_errors,
}
