"""SIMULATOR, not an NPU: a stand-in for the ``torch_npu`` module, in plain
torch on CPU tensors, for tests only.

It implements the CANN operators paged calls, from their documented
semantics in the torch_npu / op-plugin docs, plus the ``torch.npu`` calls
the platform and the worker make (the mixture-of-experts operators of
backends/npu/moe.py are at the end of this file):

- ``npu_scatter_pa_kv_cache``: key [T, N, D] into a cache [num_blocks,
  block_size, N, D] at slot = block * block_size + offset (ND; the NZ
  layout of cache_mode 'PA_NZ' is refused, not simulated);
- ``npu_fused_infer_attention_score``, paged (``block_table``), BSH layout:
  Q_S = 1 takes the incremental branch (IncreFlashAttention), Q_S > 1 the
  prompt branch (PromptFlashAttention), sparse modes 0, 3 and 4.

**Releases.** ``use_release(version)`` gives both operators the exact
signature of that torch-npu release, read from its PyPI wheel
(``RELEASES``): a keyword the release lacks is a TypeError, as the real
binding raises; ``npu_scatter_pa_kv_cache`` is absent before 2.7.1 (but for
2.1.0.post17) and takes ``cache_mode`` (default 'PA_NZ') from 2.10.0. The
default is 2.13.0. ``"2.13.0-scale_value"`` is not a release: the fused
operator with the older ``scale_value`` spelling, so the keyword choice
is exercised both ways.

**Limits** it enforces, each from the 2.13.0 documentation, so code that
passes here has the argument shapes a 910B accepts: dtypes (fp16 / bf16,
key and value as the query), contiguous tensors, the BSH shapes (H =
num_heads * D, the cache's last dim = num_key_value_heads * D), int32
block tables of at least the longest sequence's blocks,
``actual_seq_lengths_kv`` required with a block table, the block size (a
multiple of 128 up to 512 for Q_S > 1, of 16 for Q_S = 1); the pool's
block count at least the SUM of every sequence's blocks in the call;
with Q_S = 1 at most 2**31 - 1 elements in the key (and the value) tensor
and keys per sequence <= 262144, no ``sparse_mode``, a mask of [B, KV_S];
B <= 65536, N <= 256, D <= 512, N * D < 65535 for a BSH query with Q_S > 1;
sparse_mode 3 / 4 only with the fixed 2048 x 2048 mask; no padding slots in
the cache write. What it does not simulate, it refuses (other layouts and
sparse modes, quantization arguments) rather than guess.

**Block ids** are NOT checked: the operator documents that it does not
validate them ("block_table中填充的是blockid, 当前不会对blockid的合法性进行校验,
需用户自行保证"). A stray id reads memory that is not the sequence's; the
simulator reads NaN there (and counts ``calls["stray_block_reads"]``), so a
caller that lets one through gets a visibly wrong result, as on a device.

**Precision.** ``set_precision("exact")`` (the default) computes each
sequence's softmax exactly in float32: its batch invariance is trivial and
says nothing about the NPU. ``set_precision("split")`` models a split-K
flash attention instead: the keys of a sequence are cut into as many
chunks as ``AI_CORES // (B * KV_N)`` (so the cut depends on the batch, as a
kernel filling its cores does), each chunk runs an online softmax whose
probabilities are rounded to the query's dtype before ``P V``, and the
partials merge in float32. It is a model of where batch dependence comes
from, not the NPU's numerics.

It says nothing about device placement, streams, the real kernels' numerics
or speed: every tensor is on the CPU.

``HostSyncGuard`` (a TorchFunctionMode) counts, or forbids, what would be a
device->host synchronisation on a real device (``.tolist()``, ``.item()``,
``bool(t)``, ``.cpu()``, ``nonzero``, boolean-mask indexing, ...) outside the
simulated operators: tests run the backend's per-layer path inside it.
"""

from __future__ import annotations

import inspect
import math
import sys
import types

import torch
from torch.overrides import TorchFunctionMode

SIMULATOR = True
__version__ = "2.13.0+simulator"

DTYPES = (torch.float16, torch.bfloat16)
MASK_DTYPES = (torch.bool, torch.int8, torch.uint8)
CAUSAL_MASK_SIZE = 2048
MAX_BLOCK_SIZE = 512
MAX_GQA_RATIO = 64
MAX_BATCH = 65536
MAX_HEADS = 256
MAX_HEAD_DIM = 512
MAX_QUERY_HIDDEN = 65535  # N * D < this, BSH, Q_S > 1
MAX_DECODE_KV_LEN = 262144  # Q_S = 1
INT32_MAX = 2**31 - 1  # Q_S = 1: elements of the key / value tensor
AI_CORES = 20  # cube cores of a 910B: what the "split" precision model fills

#: how many calls of each operator ran (tests read it: the simulator really ran)
calls: dict[str, int] = {"npu_scatter_pa_kv_cache": 0, "npu_fused_infer_attention_score": 0,
                         "stray_block_reads": 0, "npu_moe_gating_top_k_softmax": 0, "npu_moe_init_routing": 0,
                         "npu_grouped_matmul": 0, "npu_moe_finalize_routing": 0}
_in_operator = 0  # > 0 while a simulated operator runs: its own host reads are the device's
_precision = "exact"


class SimulatedNpuError(RuntimeError):
    """A call the real operator would refuse (the message says which rule)."""


def _refuse(op: str, rule: str, got) -> None:
    raise SimulatedNpuError(f"{op} (simulated): expected {rule}, got {got}")


class _operator:
    """Marks the body of a simulated operator (not a host sync) and counts it."""

    def __init__(self, name):
        self.name = name

    def __enter__(self):
        global _in_operator
        _in_operator += 1
        calls[self.name] += 1

    def __exit__(self, *exc):
        global _in_operator
        _in_operator -= 1


def set_precision(mode: str) -> None:
    """"exact" (float32 softmax per sequence) or "split" (see the module doc)."""
    global _precision
    if mode not in ("exact", "split"):
        raise ValueError(f"precision: expected 'exact' or 'split', got {mode!r}")
    _precision = mode


# ---- releases: the operators' signatures, read from the PyPI wheels ---------------------

_SCATTER_BASE = ("key", "value", "key_cache", "value_cache", "slot_mapping")
#: keyword-only parameters of npu_scatter_pa_kv_cache (None: the release has no such operator)
_SCATTER_OLD = (("compress_lens", None), ("compress_seq_offsets", None), ("seq_lens", None))
_SCATTER_NEW = _SCATTER_OLD + (("cache_mode", "PA_NZ"),)
#: npu_fused_infer_attention_score's keyword-only parameters, the same list in every release read
_ATTENTION = (("pse_shift", None), ("atten_mask", None), ("actual_seq_lengths", None),
              ("actual_seq_lengths_kv", None), ("dequant_scale1", None), ("quant_scale1", None),
              ("dequant_scale2", None), ("quant_scale2", None), ("quant_offset2", None), ("antiquant_scale", None),
              ("antiquant_offset", None), ("key_antiquant_scale", None), ("key_antiquant_offset", None),
              ("value_antiquant_scale", None), ("value_antiquant_offset", None), ("block_table", None),
              ("query_padding_size", None), ("kv_padding_size", None), ("key_shared_prefix", None),
              ("value_shared_prefix", None), ("actual_shared_prefix_len", None), ("query_rope", None),
              ("key_rope", None), ("key_rope_antiquant_scale", None), ("num_heads", 1), ("scale", 1.0),
              ("pre_tokens", 2147483647), ("next_tokens", 2147483647), ("input_layout", "BSH"),
              ("num_key_value_heads", 0), ("sparse_mode", 0), ("inner_precise", 0), ("block_size", 0),
              ("antiquant_mode", 0), ("key_antiquant_mode", 0), ("value_antiquant_mode", 0),
              ("softmax_lse_flag", False))
#: release -> (scatter keywords or None, fused-attention keywords)
RELEASES = {
    "2.1.0.post17": (_SCATTER_OLD, _ATTENTION),
    "2.5.1": (None, _ATTENTION),  # also 2.3.1.post6, 2.4.0.post4, 2.6.0: no scatter operator
    "2.7.1": (_SCATTER_OLD, _ATTENTION),  # also 2.8.0, 2.9.0
    "2.10.0": (_SCATTER_NEW, _ATTENTION),  # also 2.11.0, 2.12.0
    "2.13.0": (_SCATTER_NEW, _ATTENTION),
    # not a release: the scale_value spelling of npu_prompt/incre_flash_attention
    "2.13.0-scale_value": (_SCATTER_NEW, tuple(("scale_value", d) if k == "scale" else (k, d)
                                                for k, d in _ATTENTION)),
}

#: releases whose prototypes were read and found equal to a key of RELEASES
SAME_AS = {"2.3.1.post6": "2.5.1", "2.4.0.post4": "2.5.1", "2.6.0": "2.5.1", "2.8.0": "2.7.1", "2.9.0": "2.7.1",
           "2.11.0": "2.10.0", "2.12.0": "2.10.0"}


def _signature(positional, keywords) -> inspect.Signature:
    params = [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in positional]
    params += [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=d) for n, d in keywords]
    return inspect.Signature(params)


def _bound(name: str, sig: inspect.Signature, impl):
    """``impl`` behind exactly ``sig``: a keyword the release lacks is a
    TypeError, as from the real binding; ``inspect.signature`` reads it."""
    def op(*args, **kwargs):
        try:
            bound = sig.bind(*args, **kwargs)
        except TypeError as e:
            raise TypeError(f"{name}(): {e} (torch_npu {__version__})") from None
        bound.apply_defaults()
        return impl(**bound.arguments)

    op.__name__ = op.__qualname__ = name
    op.__signature__ = sig
    return op


def use_release(version: str) -> None:
    """Both operators with the signatures of torch-npu ``version`` (a key of
    RELEASES); the scatter operator is removed where the release has none."""
    global __version__
    scatter, attention = RELEASES[version]
    module = sys.modules[__name__]
    if scatter is None:
        module.__dict__.pop("npu_scatter_pa_kv_cache", None)
    else:
        module.npu_scatter_pa_kv_cache = _bound("npu_scatter_pa_kv_cache", _signature(_SCATTER_BASE, scatter),
                                                _scatter)
    scale = "scale_value" if any(k == "scale_value" for k, _ in attention) else "scale"
    module.npu_fused_infer_attention_score = _bound(
        "npu_fused_infer_attention_score", _signature(("query", "key", "value"), attention),
        lambda **kw: _attention(scale=kw.pop(scale), **kw))
    __version__ = f"{version}+simulator"


# ---- npu_scatter_pa_kv_cache ----------------------------------------------------

def _scatter(key, value, key_cache, value_cache, slot_mapping, compress_lens=None, compress_seq_offsets=None,
             seq_lens=None, cache_mode=None):
    op = "npu_scatter_pa_kv_cache"
    with _operator(op):
        if compress_lens is not None or compress_seq_offsets is not None or seq_lens is not None:
            _refuse(op, "no compression arguments (not simulated)", "compression")
        if cache_mode == "PA_NZ":  # 2.10.0+'s default
            _refuse(op, "cache_mode 'Norm' or None for ND caches [blocks, block_size, N, D] ('PA_NZ', the "
                        "default since torch-npu 2.10.0, takes NZ caches [blocks, N*D/16, block_size, 16])",
                    repr(cache_mode))
        if cache_mode not in (None, "Norm"):
            _refuse(op, "cache_mode 'Norm', 'PA_NZ' or None", repr(cache_mode))
        for name, src, cache in (("key", key, key_cache), ("value", value, value_cache)):
            _check_scatter(op, name, src, cache)
        if slot_mapping.dtype not in (torch.int32, torch.int64) or slot_mapping.shape != (key.shape[0],):
            _refuse(op, f"slot_mapping int32/int64 of shape ({key.shape[0]},)",
                    f"{slot_mapping.dtype} {tuple(slot_mapping.shape)}")
        nslots = key_cache.shape[0] * key_cache.shape[1]
        slots = slot_mapping.long()
        if slots.numel() and (bool((slots < 0).any()) or bool((slots >= nslots).any())):
            _refuse(op, f"every slot in [0, {nslots}) (no padding slots)", slots.tolist())
        n, d = key.shape[1], key.shape[2]
        key_cache.view(nslots, n, d)[slots] = key
        value_cache.view(nslots, n, d)[slots] = value


def _check_scatter(op, name, src, cache):
    if src.dtype not in DTYPES or cache.dtype != src.dtype:
        _refuse(op, f"{name} and {name}_cache both float16 or bfloat16", f"{src.dtype} / {cache.dtype}")
    if src.dim() != 3 or cache.dim() != 4 or cache.shape[2:] != src.shape[1:]:
        _refuse(op, f"{name} [T, N, D] and {name}_cache [blocks, block_size, N, D]",
                f"{tuple(src.shape)} / {tuple(cache.shape)}")
    if not (src.is_contiguous() and cache.is_contiguous()):
        _refuse(op, f"contiguous {name} and {name}_cache", "a strided tensor")


# ---- npu_fused_infer_attention_score ------------------------------------------------

_UNSIMULATED = ("pse_shift", "dequant_scale1", "quant_scale1", "dequant_scale2", "quant_scale2", "quant_offset2",
                "antiquant_scale", "antiquant_offset", "query_padding_size", "kv_padding_size",
                "key_antiquant_scale", "key_antiquant_offset", "value_antiquant_scale", "value_antiquant_offset",
                "key_shared_prefix", "value_shared_prefix", "actual_shared_prefix_len", "query_rope", "key_rope",
                "key_rope_antiquant_scale")


def _attention(query, key, value, *, atten_mask=None, actual_seq_lengths=None, actual_seq_lengths_kv=None,
               block_table=None, num_heads=1, scale=1.0, pre_tokens=2147483647, next_tokens=2147483647,
               input_layout="BSH", num_key_value_heads=0, sparse_mode=0, inner_precise=0, block_size=0,
               softmax_lse_flag=False, antiquant_mode=0, key_antiquant_mode=0, value_antiquant_mode=0, **others):
    op = "npu_fused_infer_attention_score"
    with _operator(op):
        given = sorted(k for k in _UNSIMULATED if others.get(k) is not None)
        if given or antiquant_mode or key_antiquant_mode or value_antiquant_mode or softmax_lse_flag:
            _refuse(op, "only the arguments the simulator implements", given or "a quantization / lse flag")
        if input_layout != "BSH":
            _refuse(op, 'input_layout "BSH" (the only layout simulated)', repr(input_layout))
        if block_table is None:
            _refuse(op, "a block_table (only paged attention is simulated)", None)
        nkv = num_key_value_heads or num_heads
        q_s = query.shape[1] if query.dim() == 3 else 0
        geo = _check_paged(op, query, key, value, block_table, num_heads, nkv, block_size, actual_seq_lengths_kv,
                           q_s)
        multiple = 16 if q_s == 1 else 128  # paged attention's block size, per branch
        if block_size % multiple or not 0 < block_size <= MAX_BLOCK_SIZE:
            _refuse(op, f"block_size a multiple of {multiple} up to {MAX_BLOCK_SIZE} with Q_S = {q_s}"
                        + (" (Q_S > 1)" if q_s > 1 else ""), block_size)
        if q_s == 1:
            q_lens, masks = _incremental_rules(op, query, key, atten_mask, sparse_mode, actual_seq_lengths_kv)
        else:
            q_lens, masks = _prompt_rules(op, query, atten_mask, sparse_mode, actual_seq_lengths,
                                          actual_seq_lengths_kv, pre_tokens, next_tokens)
        out = _attend(query, key, value, block_table, geo, q_lens, list(actual_seq_lengths_kv), masks, scale)
        return out, torch.empty(0, dtype=torch.float32)


def _check_paged(op, query, key, value, block_table, num_heads, nkv, block_size, kv_lens, q_s):
    if query.dtype not in DTYPES or key.dtype != query.dtype or value.dtype != query.dtype:
        _refuse(op, "query, key and value all float16 or all bfloat16", f"{query.dtype}/{key.dtype}/{value.dtype}")
    if query.dim() != 3 or query.shape[2] % num_heads:
        _refuse(op, f"query [B, S, H] with H a multiple of num_heads {num_heads}", tuple(query.shape))
    d = query.shape[2] // num_heads
    b = query.shape[0]
    if b > MAX_BATCH or num_heads > MAX_HEADS or d > MAX_HEAD_DIM:
        _refuse(op, f"B <= {MAX_BATCH}, N <= {MAX_HEADS}, D <= {MAX_HEAD_DIM}", (b, num_heads, d))
    if q_s > 1 and num_heads * d >= MAX_QUERY_HIDDEN:
        _refuse(op, f"N * D < {MAX_QUERY_HIDDEN} for a BSH query with Q_S > 1", num_heads * d)
    if num_heads % nkv or num_heads // nkv > MAX_GQA_RATIO:
        _refuse(op, f"num_heads / num_key_value_heads an integer up to {MAX_GQA_RATIO}", f"{num_heads}/{nkv}")
    if key.dim() != 3 or key.shape != value.shape or key.shape[1] != block_size or key.shape[2] != nkv * d:
        _refuse(op, f"key/value caches [blocks, block_size={block_size}, {nkv}*{d}] (BSH paged)",
                f"{tuple(key.shape)} / {tuple(value.shape)}")
    if q_s == 1 and key.numel() > INT32_MAX:  # documented for the incremental branch only
        _refuse(op, f"with Q_S = 1 at most {INT32_MAX} elements in key and in value (int32)", key.numel())
    if not (query.is_contiguous() and key.is_contiguous() and value.is_contiguous()):
        _refuse(op, "contiguous query, key and value", "a strided tensor")
    if d % 16:
        _refuse(op, "a head dim that is a multiple of 16 (float16 / bfloat16)", d)
    if block_table.dtype != torch.int32 or block_table.dim() != 2 or block_table.shape[0] != b:
        _refuse(op, f"block_table int32 [B={b}, max_blocks]", f"{block_table.dtype} {tuple(block_table.shape)}")
    if kv_lens is None or len(kv_lens) != b:
        _refuse(op, f"actual_seq_lengths_kv with one length per batch row ({b})", kv_lens)
    cap = block_table.shape[1] * block_size
    if any(not isinstance(n, int) or not 0 < n <= cap for n in kv_lens):
        _refuse(op, f"actual_seq_lengths_kv a host list of ints in [1, {cap}] (the block table's width)", kv_lens)
    spanned = sum(-(-n // block_size) for n in kv_lens)
    if spanned > key.shape[0]:
        _refuse(op, f"a pool of at least the {spanned} blocks the batch's sequences span (their blocks summed)",
                f"{key.shape[0]} blocks")
    return types.SimpleNamespace(heads=num_heads, kv_heads=nkv, d=d, block_size=block_size)


def _incremental_rules(op, query, key, mask, sparse_mode, kv_lens):
    """Q_S = 1 (IncreFlashAttention): sparse_mode is not valid, a mask is [B, KV_S]."""
    if sparse_mode != 0:
        _refuse(op, "sparse_mode 0 with Q_S = 1 (the incremental branch takes none)", f"sparse_mode={sparse_mode}")
    if max(kv_lens) > MAX_DECODE_KV_LEN:
        _refuse(op, f"keys per sequence <= {MAX_DECODE_KV_LEN} with Q_S = 1", max(kv_lens))
    b = query.shape[0]
    if mask is None:
        return [1] * b, [None] * b
    if mask.dtype not in MASK_DTYPES or mask.dim() not in (2, 3, 4) or mask.shape[0] != b \
            or any(x != 1 for x in mask.shape[1:-1]) or mask.shape[-1] < max(kv_lens):
        _refuse(op, f"with Q_S = 1 a bool/int8 atten_mask [B={b}, KV_S >= {max(kv_lens)}]",
                f"{mask.dtype} {tuple(mask.shape)}")
    rows = mask.reshape(b, mask.shape[-1]).bool()
    return [1] * b, [rows[i:i + 1] for i in range(b)]


def _prompt_rules(op, query, mask, sparse_mode, q_lens, kv_lens, pre_tokens, next_tokens):
    """Q_S > 1 (PromptFlashAttention): sparse_mode 0 (explicit or no mask),
    3 (right-down causal) or 4 (band, anchored like 3), the last two with
    the fixed 2048 x 2048 mask."""
    b, q_s = query.shape[0], query.shape[1]
    q_lens = [q_s] * b if q_lens is None else list(q_lens)
    if len(q_lens) != b or any(not isinstance(n, int) or not 0 < n <= q_s for n in q_lens):
        _refuse(op, f"actual_seq_lengths a host list of {b} ints in [1, {q_s}]", q_lens)
    if sparse_mode in (3, 4):
        if any(q > k for q, k in zip(q_lens, kv_lens)):
            _refuse(op, f"query lengths <= key lengths with sparse_mode {sparse_mode}", (q_lens, kv_lens))
        _check_causal_mask(op, mask, sparse_mode)
        if sparse_mode == 3:
            return q_lens, [_band(q, k, None, 0) for q, k in zip(q_lens, kv_lens)]
        if pre_tokens < 0 or next_tokens < 0:  # negative bands: allowed by the docs, not simulated
            _refuse(op, "pre_tokens >= 0 and next_tokens >= 0 (the band simulated)", (pre_tokens, next_tokens))
        return q_lens, [_band(q, k, pre_tokens, next_tokens) for q, k in zip(q_lens, kv_lens)]
    if sparse_mode != 0:
        _refuse(op, "sparse_mode 0, 3 or 4 (the ones simulated)", sparse_mode)
    if mask is None:
        return q_lens, [None] * b
    shapes = {(b, 1, q_s), (b, q_s), (1, q_s), (q_s,)}
    if mask.dtype not in MASK_DTYPES or tuple(mask.shape[:-1]) not in shapes or mask.shape[-1] < max(kv_lens):
        _refuse(op, f"atten_mask [B, 1, Q_S={q_s}, KV_S] (or [Q_S, KV_S]) bool/int8 with KV_S >= {max(kv_lens)}",
                f"{mask.dtype} {tuple(mask.shape)}")
    m = mask.bool().reshape(-1, q_s, mask.shape[-1]).expand(b, q_s, mask.shape[-1])
    return q_lens, [m[i, :q_lens[i]] for i in range(b)]


_checked_masks: set = set()


def _check_causal_mask(op, mask, sparse_mode):
    """sparse_mode 3 and 4 take the compressed mask: 2048 x 2048, True strictly above the diagonal."""
    if mask is None or mask.dtype not in MASK_DTYPES or tuple(mask.shape) != (CAUSAL_MASK_SIZE, CAUSAL_MASK_SIZE):
        _refuse(op, f"with sparse_mode {sparse_mode} a 2048 x 2048 bool/int8 atten_mask",
                None if mask is None else f"{mask.dtype} {tuple(mask.shape)}")
    key = mask.data_ptr()  # content checked once per tensor (masks are made once and never written)
    if key not in _checked_masks:
        want = torch.ones(CAUSAL_MASK_SIZE, CAUSAL_MASK_SIZE, dtype=torch.bool).triu_(1)
        if not torch.equal(mask.bool(), want):
            _refuse(op, f"the upper-triangular (strict) 2048 x 2048 mask with sparse_mode {sparse_mode}",
                    "another mask")
        _checked_masks.add(key)


def _band(q: int, k: int, pre_tokens: int | None, next_tokens: int) -> torch.Tensor:
    """[q, k] True = masked, anchored at the bottom-right corner: query row r
    sits at position p = k - q + r and sees keys p - pre_tokens <= j <=
    p + next_tokens (pre_tokens None: every earlier key, sparse_mode 3)."""
    pos = torch.arange(q)[:, None] + (k - q)
    j = torch.arange(k)[None, :]
    masked = j > pos + next_tokens
    return masked | (j < pos - pre_tokens) if pre_tokens is not None else masked


def _gather(cache, ids, geo, n):
    """A sequence's first ``n`` rows [n, KV_N, D] in float32; a stray block
    id (the operator does not check them) reads NaN."""
    stray = (ids < 0) | (ids >= cache.shape[0])
    rows = cache[ids.clamp(0, cache.shape[0] - 1)].float()
    if bool(stray.any()):
        rows[stray] = math.nan
    return rows.reshape(-1, geo.kv_heads, geo.d)[:n]


def _attend(query, key, value, block_table, geo, q_lens, kv_lens, masks, scale):
    b, q_s, _ = query.shape
    out = torch.zeros_like(query)
    ratio = geo.heads // geo.kv_heads
    splits = max(1, AI_CORES // (b * geo.kv_heads))  # the "split" model: the batch decides the cut
    for i in range(b):
        n, q = kv_lens[i], q_lens[i]
        ids = block_table[i, :-(-n // geo.block_size)].long()
        calls["stray_block_reads"] += int(((ids < 0) | (ids >= key.shape[0])).sum())
        k = _gather(key, ids, geo, n).repeat_interleave(ratio, dim=1)
        v = _gather(value, ids, geo, n).repeat_interleave(ratio, dim=1)
        qi = query[i, :q].reshape(q, geo.heads, geo.d).float()
        s = torch.einsum("qhd,khd->hqk", qi, k) * float(scale)
        if masks[i] is not None:
            s = s.masked_fill(masks[i][:, :n].expand(q, n)[None], -math.inf)
        if _precision == "split":
            o = _split_softmax_pv(s, v, min(splits, n), query.dtype)
        else:  # a fully masked row gives zeros; a NaN (stray block) stays NaN
            p = torch.softmax(s, dim=-1).masked_fill((s == -math.inf).all(-1, keepdim=True), 0.0)
            o = torch.einsum("hqk,khd->qhd", p, v)
        out[i, :q] = o.reshape(q, -1).to(query.dtype)
    return out


def _split_softmax_pv(s, v, splits, dtype):
    """Online softmax over ``splits`` key chunks, P rounded to ``dtype``
    before P V, partials merged in float32 (the "split" precision model)."""
    h, q, _ = s.shape
    m = torch.full((h, q, 1), -math.inf)
    l, o = torch.zeros(h, q, 1), torch.zeros(h, q, v.shape[-1])
    for idx in torch.tensor_split(torch.arange(s.shape[-1]), splits):
        sc = s[..., idx]
        m_new = torch.maximum(m, sc.amax(-1, keepdim=True))
        safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        p = torch.exp(sc - safe)
        alpha = torch.exp(m - safe)
        l = l * alpha + p.sum(-1, keepdim=True)
        o = o * alpha + torch.einsum("hqk,khd->hqd", p.to(dtype).float(), v[idx])
        m = m_new
    return torch.where(l == 0, 0.0, o / l).transpose(0, 1)  # fully masked: zeros; NaN stays NaN


use_release("2.13.0")


# ---- torch.npu: the calls the platform and the worker make --------------------------------

#: the simulated device's memory: a fixed 64 GiB device with 60 GiB free and
#: nothing allocated through torch (the simulator's tensors are host tensors)
SIM_TOTAL, SIM_FREE = 64 * 2**30, 60 * 2**30

npu = types.SimpleNamespace(
    device_count=lambda: 1,
    is_available=lambda: True,
    current_device=lambda: npu.selected,
    set_device=lambda index: setattr(npu, "selected", int(index.index if isinstance(index, torch.device) else index)),
    synchronize=lambda device=None: None,
    mem_get_info=lambda device=None: (SIM_FREE, SIM_TOTAL),
    memory_reserved=lambda device=None: 0,
    memory_allocated=lambda device=None: 0,
    max_memory_allocated=lambda device=None: 0,
    reset_peak_memory_stats=lambda device=None: None,
    empty_cache=lambda: None,
    get_device_name=lambda index=0: "simulated Ascend NPU (plain torch on CPU tensors)",
    selected=0,
)


# ---- host syncs ---------------------------------------------------------------------

# ---- mixture-of-experts operators (backends/npu/moe.py) ---------------------------------
# Each from its torch_npu prototype and documented formula (Ascend's torch_npu
# API reference, 6.0.RC3 / 7.0.0): the inference-only, dropless,
# non-quantized case; what else the operators offer is refused, not guessed.

MOE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
GMM_DTYPES = (torch.float16, torch.bfloat16)
MAX_GMM_GROUPS = 128  # TensorList length limit of npu_grouped_matmul
MAX_ROUTING_ELEMENTS = 2**24  # npu_moe_init_routing: x's shape size below this
MAX_GATING_K = 1024


def npu_moe_gating_top_k_softmax(x, finished=None, k=1):
    """softmax(x, -1) (float32 inside) -> its top k, rounded to x's dtype,
    their expert ids (int32) and row_idx (int32): row_idx[r, j] = j * rows + r.
    A ``finished`` row's ids are the expert count."""
    op = "npu_moe_gating_top_k_softmax"
    with _operator(op):
        if x.dim() != 2 or x.dtype not in MOE_DTYPES:
            _refuse(op, f"a 2-D x of {MOE_DTYPES}", f"{tuple(x.shape)} {x.dtype}")
        rows, experts = x.shape
        if not 0 < k <= min(experts, MAX_GATING_K):
            _refuse(op, f"0 < k <= min(experts, {MAX_GATING_K})", k)
        y, ids = torch.topk(torch.softmax(x.float(), dim=-1), k, dim=-1)
        ids = ids.to(torch.int32)
        if finished is not None:
            if finished.dtype != torch.bool or tuple(finished.shape) != (rows,):
                _refuse(op, f"finished bool [{rows}]", f"{finished.dtype} {tuple(finished.shape)}")
            ids[finished] = experts
        row_idx = torch.arange(rows * k, dtype=torch.int32).view(k, rows).t().contiguous()
        return y.to(x.dtype), ids, row_idx


def npu_moe_init_routing(x, row_idx, expert_idx, active_num):
    """Slots (row r's j-th choice, flat index r * k + j) sorted by expert,
    stably -> expanded_x (x's row of each sorted slot: row_idx % rows),
    expanded_row_idx (expanded_row_idx[row_idx of a slot] = its sorted
    position) and the sorted expert ids."""
    op = "npu_moe_init_routing"
    with _operator(op):
        if x.dim() != 2 or x.dtype not in MOE_DTYPES or x.numel() >= MAX_ROUTING_ELEMENTS:
            _refuse(op, f"a 2-D x of {MOE_DTYPES} under 2**24 elements", f"{tuple(x.shape)} {x.dtype}")
        for name, t in (("row_idx", row_idx), ("expert_idx", expert_idx)):
            if t.dtype != torch.int32 or t.dim() != 2 or t.shape[0] != x.shape[0]:
                _refuse(op, f"{name} int32 [{x.shape[0]}, k]", f"{t.dtype} {tuple(t.shape)}")
        if row_idx.shape != expert_idx.shape:
            _refuse(op, "row_idx shaped as expert_idx", f"{tuple(row_idx.shape)} vs {tuple(expert_idx.shape)}")
        rows, k = expert_idx.shape
        order = torch.argsort(expert_idx.reshape(-1), stable=True)
        sources = row_idx.reshape(-1)[order].long()
        expanded_row_idx = torch.empty(rows * k, dtype=torch.int32)
        expanded_row_idx[sources] = torch.arange(rows * k, dtype=torch.int32)
        active = min(rows, active_num) * k
        return x[sources[:active] % rows], expanded_row_idx, expert_idx.reshape(-1)[order]


def npu_grouped_matmul(x, weight, *, bias=None, scale=None, offset=None, antiquant_scale=None,
                       antiquant_offset=None, per_token_scale=None, group_list=None, activation_input=None,
                       activation_quant_scale=None, activation_quant_offset=None, split_item=0, group_type=-1,
                       group_list_type=0, act_type=0, output_dtype=None):
    """One x split along M (group_type 0) by ``group_list`` (a device
    tensor, cumulative ends with group_list_type 0 or counts with 1), one
    2-D weight [K, N] per group, one output (split_item 2 or 3): rows of
    group g times weight[g], float32 inside, rounded once."""
    op = "npu_grouped_matmul"
    with _operator(op):
        unsimulated = {k: v for k, v in dict(bias=bias, scale=scale, offset=offset, antiquant_scale=antiquant_scale,
                                             antiquant_offset=antiquant_offset, per_token_scale=per_token_scale,
                                             activation_input=activation_input, output_dtype=output_dtype).items()
                       if v is not None}
        if unsimulated or act_type != 0:
            _refuse(op, "no bias, quantization or fused activation (not simulated)", sorted(unsimulated) or act_type)
        if len(x) != 1 or split_item not in (2, 3) or group_type != 0 or not isinstance(group_list, torch.Tensor):
            _refuse(op, "one x split along M by a group_list tensor (split_item 2/3, group_type 0; "
                    "the only case simulated)", f"{len(x)} x, split_item {split_item}, group_type {group_type}, "
                    f"group_list {type(group_list).__name__}")
        a = x[0]
        if a.dim() != 2 or a.dtype not in GMM_DTYPES or not a.is_contiguous():
            _refuse(op, f"a contiguous 2-D x of {GMM_DTYPES}", f"{tuple(a.shape)} {a.dtype}")
        if not 0 < len(weight) <= MAX_GMM_GROUPS:
            _refuse(op, f"1 to {MAX_GMM_GROUPS} weights", len(weight))
        if any(w.dim() != 2 or w.dtype != a.dtype or w.shape != weight[0].shape or w.shape[0] != a.shape[1]
               for w in weight):
            _refuse(op, f"2-D weights [{a.shape[1]}, N] of {a.dtype}", [(tuple(w.shape), w.dtype) for w in weight])
        if group_list.dtype != torch.int64 or tuple(group_list.shape) != (len(weight),):
            _refuse(op, f"group_list int64 [{len(weight)}]", f"{group_list.dtype} {tuple(group_list.shape)}")
        if group_list_type not in (0, 1):
            _refuse(op, "group_list_type 0 (cumulative) or 1 (counts)", group_list_type)
        ends = group_list.cumsum(0) if group_list_type == 1 else group_list
        if bool((ends[1:] < ends[:-1]).any()) or int(ends[0]) < 0 or int(ends[-1]) > a.shape[0]:
            _refuse(op, f"non-decreasing group ends within the {a.shape[0]} rows", group_list.tolist())
        out = torch.zeros(a.shape[0], weight[0].shape[1], dtype=torch.float32)
        start = 0
        for w, end in zip(weight, ends.tolist()):
            out[start:end] = a[start:end].float() @ w.float()
            start = end
        return [out.to(a.dtype)]


def npu_moe_finalize_routing(expanded_permuted_rows, skip1, skip2, bias, scales, expanded_src_to_dst_row,
                             export_for_source_row, drop_pad_mode=0):
    """out[i] = sum over j of scales[i, j] * rows[expanded_src_to_dst_row[i
    + j * NUM_ROWS]] (float32 inside, rounded once to the rows' dtype; the
    skip and bias terms are not simulated)."""
    op = "npu_moe_finalize_routing"
    with _operator(op):
        rows_in = expanded_permuted_rows
        if skip1 is not None or skip2 is not None or bias is not None or drop_pad_mode != 0:
            _refuse(op, "no skip1 / skip2 / bias, drop_pad_mode 0 (the only case simulated)",
                    [n for n, v in (("skip1", skip1), ("skip2", skip2), ("bias", bias)) if v is not None]
                    or drop_pad_mode)
        if rows_in.dim() != 2 or rows_in.dtype not in MOE_DTYPES:
            _refuse(op, f"2-D expanded_permuted_rows of {MOE_DTYPES}", f"{tuple(rows_in.shape)} {rows_in.dtype}")
        if scales is None or scales.dim() != 2 or scales.dtype != rows_in.dtype:
            _refuse(op, f"scales [NUM_ROWS, K] of {rows_in.dtype}", None if scales is None else scales.dtype)
        rows, k = scales.shape
        if rows_in.shape[0] != rows * k:
            _refuse(op, f"{rows * k} expanded rows (NUM_ROWS * K)", rows_in.shape[0])
        dst = expanded_src_to_dst_row
        if dst.dtype != torch.int32 or tuple(dst.shape) != (rows * k,) or int(dst.min()) < 0 \
                or int(dst.max()) >= rows * k:
            _refuse(op, f"expanded_src_to_dst_row int32 [{rows * k}] in [0, {rows * k})",
                    f"{dst.dtype} {tuple(dst.shape)}")
        if export_for_source_row is not None and (export_for_source_row.dtype != torch.int32
                                                  or tuple(export_for_source_row.shape) != (rows, k)):
            _refuse(op, f"export_for_source_row int32 [{rows}, {k}]", tuple(export_for_source_row.shape))
        picked = rows_in.float()[dst.long().view(k, rows)]  # [K, NUM_ROWS, H]: choice j of row i at [j, i]
        return (picked * scales.float().t().unsqueeze(-1)).sum(0).to(rows_in.dtype)


#: Tensor methods that copy device data to the host (a sync on a real device)
SYNC_METHODS = {"tolist", "item", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy", "nonzero",
                "masked_select", "argwhere", "unique", "unique_consecutive"}


class HostSyncGuard(TorchFunctionMode):
    """Records every would-be device->host sync outside the simulated
    operators (``syncs``: the method names); with ``forbid`` raises at the
    first one instead."""

    def __init__(self, forbid: bool = False):
        super().__init__()
        self.forbid, self.syncs = forbid, []

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if not _in_operator and _is_sync(name, args, kwargs):
            self.syncs.append(name)
            if self.forbid:
                raise AssertionError(f"host sync in the per-layer path: Tensor.{name}")
        return func(*args, **kwargs)


def _is_sync(name: str, args, kwargs) -> bool:
    if name in SYNC_METHODS:
        return True
    if name == "to":  # .to("cpu") / .to(torch.device("cpu"))
        target = kwargs.get("device", args[1] if len(args) > 1 else None)
        return str(target) == "cpu"
    if name == "__getitem__" and len(args) > 1:  # boolean-mask indexing: a data-dependent shape
        index = args[1] if isinstance(args[1], tuple) else (args[1],)
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index)
    return False
