"""SIMULATOR, not an NPU: a stand-in for the ``torch_npu`` module, in plain
torch on CPU tensors, for tests only.

It implements the two CANN operators NpuBackend calls, from their documented
semantics in the torch_npu / op-plugin docs (torch_npu 2.13.0 API), plus the
few ``torch.npu`` calls the platform makes:

- ``npu_scatter_pa_kv_cache`` (cache_mode "Norm": key [T, N, D] into a cache
  [num_blocks, block_size, N, D] at slot = block * block_size + offset);
- ``npu_fused_infer_attention_score``, paged (``block_table``), BSH layout:
  Q_S = 1 takes the incremental branch (IncreFlashAttention), Q_S > 1 the
  prompt branch (PromptFlashAttention).

Beyond the arithmetic it enforces the rules that make a real call fail, so
code that passes here has the argument shapes a 910B accepts: dtypes
(fp16 / bf16, key and value as the query), a contiguous query, the BSH
shapes (H = num_heads * D, the cache's last dim = num_key_value_heads * D),
int32 block tables with valid ids, ``actual_seq_lengths_kv`` required with a
block table, the block size (a multiple of 128 up to 512 for Q_S > 1, of 16
for Q_S = 1), ``sparse_mode`` not valid with Q_S = 1 and a mask there of
[B, KV_S], sparse_mode 3's fixed 2048 x 2048 mask, no padding slots in the
cache write. What it does not simulate, it refuses (other layouts, sparse
modes, quantization arguments) rather than guess.

It says nothing about device placement, streams, the real kernels' numerics
or speed: every tensor is on the CPU and every sum is float32.

``HostSyncGuard`` (a TorchFunctionMode) counts, or forbids, what would be a
device->host synchronisation on a real device (``.tolist()``, ``.item()``,
``bool(t)``, ``.cpu()``, ``nonzero``, boolean-mask indexing, ...) outside the
simulated operators: tests run the backend's per-layer path inside it.
"""

from __future__ import annotations

import math
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

#: how many calls of each operator ran (tests read it: the simulator really ran)
calls: dict[str, int] = {"npu_scatter_pa_kv_cache": 0, "npu_fused_infer_attention_score": 0}
_in_operator = 0  # > 0 while a simulated operator runs: its own host reads are the device's


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


# ---- npu_scatter_pa_kv_cache ----------------------------------------------------

def npu_scatter_pa_kv_cache(key, value, key_cache, value_cache, slot_mapping, *, compress_lens=None,
                            compress_seq_offset=None, seq_lens=None, cache_mode="Norm", **unsupported):
    op = "npu_scatter_pa_kv_cache"
    with _operator(op):
        if unsupported or compress_lens is not None or compress_seq_offset is not None or seq_lens is not None:
            _refuse(op, "no compression arguments (not simulated)", sorted(unsupported) or "compression")
        if cache_mode != "Norm":
            _refuse(op, 'cache_mode "Norm" (the only one simulated)', repr(cache_mode))
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
                "key_shared_prefix", "value_shared_prefix", "actual_shared_prefix_len")


def npu_fused_infer_attention_score(query, key, value, *, atten_mask=None, actual_seq_lengths=None,
                                    actual_seq_lengths_kv=None, block_table=None, num_heads=1, scale=1.0,
                                    pre_tokens=2147483647, next_tokens=2147483647, input_layout="BSH",
                                    num_key_value_heads=0, sparse_mode=0, inner_precise=0, block_size=0,
                                    softmax_lse_flag=False, **others):
    op = "npu_fused_infer_attention_score"
    with _operator(op):
        given = sorted(k for k, v in others.items() if v is not None and not (k.endswith("_mode") and v == 0))
        if given or set(others) - set(_UNSIMULATED) - {"antiquant_mode", "key_antiquant_mode",
                                                        "value_antiquant_mode"}:
            _refuse(op, "only the arguments the simulator implements", given or sorted(others))
        if input_layout != "BSH":
            _refuse(op, 'input_layout "BSH" (the only layout simulated)', repr(input_layout))
        if block_table is None:
            _refuse(op, "a block_table (only paged attention is simulated)", None)
        nkv = num_key_value_heads or num_heads
        geo = _check_paged(op, query, key, value, block_table, num_heads, nkv, block_size, actual_seq_lengths_kv)
        q_s = query.shape[1]
        multiple = 16 if q_s == 1 else 128  # paged attention's block size, per branch
        if block_size % multiple or not 0 < block_size <= MAX_BLOCK_SIZE:
            _refuse(op, f"block_size a multiple of {multiple} up to {MAX_BLOCK_SIZE} with Q_S = {q_s}"
                        + (" (Q_S > 1)" if q_s > 1 else ""), block_size)
        if q_s == 1:
            q_lens, masks = _incremental_rules(op, query, atten_mask, sparse_mode, actual_seq_lengths_kv)
        else:
            q_lens, masks = _prompt_rules(op, query, atten_mask, sparse_mode, actual_seq_lengths,
                                          actual_seq_lengths_kv)
        out = _attend(query, key, value, block_table, geo, q_lens, list(actual_seq_lengths_kv), masks, scale)
        return out, torch.empty(0, dtype=torch.float32)


def _check_paged(op, query, key, value, block_table, num_heads, nkv, block_size, kv_lens):
    if query.dtype not in DTYPES or key.dtype != query.dtype or value.dtype != query.dtype:
        _refuse(op, "query, key and value all float16 or all bfloat16", f"{query.dtype}/{key.dtype}/{value.dtype}")
    if not query.is_contiguous():
        _refuse(op, "a contiguous query", "a strided query")
    if query.dim() != 3 or query.shape[2] % num_heads:
        _refuse(op, f"query [B, S, H] with H a multiple of num_heads {num_heads}", tuple(query.shape))
    d = query.shape[2] // num_heads
    if num_heads % nkv or num_heads // nkv > MAX_GQA_RATIO:
        _refuse(op, f"num_heads / num_key_value_heads an integer up to {MAX_GQA_RATIO}", f"{num_heads}/{nkv}")
    if key.dim() != 3 or key.shape != value.shape or key.shape[1] != block_size or key.shape[2] != nkv * d:
        _refuse(op, f"key/value caches [blocks, block_size={block_size}, {nkv}*{d}] (BSH paged)",
                f"{tuple(key.shape)} / {tuple(value.shape)}")
    if d % 16:
        _refuse(op, "a head dim that is a multiple of 16 (float16 / bfloat16)", d)
    if block_table.dtype != torch.int32 or block_table.dim() != 2 or block_table.shape[0] != query.shape[0]:
        _refuse(op, f"block_table int32 [B={query.shape[0]}, max_blocks]",
                f"{block_table.dtype} {tuple(block_table.shape)}")
    if kv_lens is None or len(kv_lens) != query.shape[0]:
        _refuse(op, f"actual_seq_lengths_kv with one length per batch row ({query.shape[0]})", kv_lens)
    cap = block_table.shape[1] * block_size
    if any(not isinstance(n, int) or not 0 < n <= cap for n in kv_lens):
        _refuse(op, f"actual_seq_lengths_kv a host list of ints in [1, {cap}]", kv_lens)
    for b, n in enumerate(kv_lens):
        ids = block_table[b, :-(-n // block_size)]
        if bool((ids < 0).any()) or bool((ids >= key.shape[0]).any()):
            _refuse(op, f"block ids in [0, {key.shape[0]}) for the {n} tokens of batch row {b}", ids.tolist())
    return types.SimpleNamespace(heads=num_heads, kv_heads=nkv, d=d, block_size=block_size)


def _incremental_rules(op, query, mask, sparse_mode, kv_lens):
    """Q_S = 1 (IncreFlashAttention): sparse_mode is not valid, a mask is [B, KV_S]."""
    if sparse_mode != 0:
        _refuse(op, "sparse_mode 0 with Q_S = 1 (the incremental branch takes none)", f"sparse_mode={sparse_mode}")
    b = query.shape[0]
    if mask is None:
        return [1] * b, [None] * b
    if mask.dtype not in MASK_DTYPES or mask.dim() not in (2, 3, 4) or mask.shape[0] != b \
            or any(x != 1 for x in mask.shape[1:-1]) or mask.shape[-1] < max(kv_lens):
        _refuse(op, f"with Q_S = 1 a bool/int8 atten_mask [B={b}, KV_S >= {max(kv_lens)}]",
                f"{mask.dtype} {tuple(mask.shape)}")
    rows = mask.reshape(b, mask.shape[-1]).bool()
    return [1] * b, [rows[i:i + 1] for i in range(b)]


def _prompt_rules(op, query, mask, sparse_mode, q_lens, kv_lens):
    """Q_S > 1 (PromptFlashAttention): sparse_mode 0 (explicit or no mask) or
    3 (right-down causal with the fixed 2048 x 2048 mask)."""
    b, q_s = query.shape[0], query.shape[1]
    q_lens = [q_s] * b if q_lens is None else list(q_lens)
    if len(q_lens) != b or any(not isinstance(n, int) or not 0 < n <= q_s for n in q_lens):
        _refuse(op, f"actual_seq_lengths a host list of {b} ints in [1, {q_s}]", q_lens)
    if sparse_mode == 3:
        if any(q > k for q, k in zip(q_lens, kv_lens)):
            _refuse(op, "query lengths <= key lengths with right-down causal (sparse_mode 3)", (q_lens, kv_lens))
        _check_causal_mask(op, mask)
        return q_lens, [_right_down(q, k) for q, k in zip(q_lens, kv_lens)]
    if sparse_mode != 0:
        _refuse(op, "sparse_mode 0 or 3 (the ones simulated)", sparse_mode)
    if mask is None:
        return q_lens, [None] * b
    shapes = {(b, 1, q_s), (b, q_s), (1, q_s), (q_s,)}
    if mask.dtype not in MASK_DTYPES or tuple(mask.shape[:-1]) not in shapes or mask.shape[-1] < max(kv_lens):
        _refuse(op, f"atten_mask [B, 1, Q_S={q_s}, KV_S] (or [Q_S, KV_S]) bool/int8 with KV_S >= {max(kv_lens)}",
                f"{mask.dtype} {tuple(mask.shape)}")
    m = mask.bool().reshape(-1, q_s, mask.shape[-1]).expand(b, q_s, mask.shape[-1])
    return q_lens, [m[i, :q_lens[i]] for i in range(b)]


_checked_masks: set = set()


def _check_causal_mask(op, mask):
    """sparse_mode 3 takes the compressed mask: 2048 x 2048, True strictly above the diagonal."""
    if mask is None or mask.dtype not in MASK_DTYPES or tuple(mask.shape) != (CAUSAL_MASK_SIZE, CAUSAL_MASK_SIZE):
        _refuse(op, "with sparse_mode 3 a 2048 x 2048 bool/int8 atten_mask",
                None if mask is None else f"{mask.dtype} {tuple(mask.shape)}")
    key = mask.data_ptr()  # content checked once per tensor (masks are made once and never written)
    if key not in _checked_masks:
        want = torch.ones(CAUSAL_MASK_SIZE, CAUSAL_MASK_SIZE, dtype=torch.bool).triu_(1)
        if not torch.equal(mask.bool(), want):
            _refuse(op, "the upper-triangular (strict) 2048 x 2048 mask with sparse_mode 3", "another mask")
        _checked_masks.add(key)


def _right_down(q: int, k: int) -> torch.Tensor:
    """[q, k] True = masked: query row r sits at position k - q + r."""
    pos = torch.arange(q)[:, None] + (k - q)
    return torch.arange(k)[None, :] > pos


def _attend(query, key, value, block_table, geo, q_lens, kv_lens, masks, scale):
    b, q_s, _ = query.shape
    out = torch.zeros_like(query)
    ratio = geo.heads // geo.kv_heads
    for i in range(b):
        n, q = kv_lens[i], q_lens[i]
        ids = block_table[i, :-(-n // geo.block_size)].long()
        k = key[ids].reshape(-1, geo.kv_heads, geo.d)[:n].float().repeat_interleave(ratio, dim=1)
        v = value[ids].reshape(-1, geo.kv_heads, geo.d)[:n].float().repeat_interleave(ratio, dim=1)
        qi = query[i, :q].reshape(q, geo.heads, geo.d).float()
        s = torch.einsum("qhd,khd->hqk", qi, k) * float(scale)
        if masks[i] is not None:
            s = s.masked_fill(masks[i][:, :n].expand(q, n)[None], -math.inf)
        p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # a fully masked row gives zeros
        out[i, :q] = torch.einsum("hqk,khd->qhd", p, v).reshape(q, -1).to(query.dtype)
    return out


# ---- torch.npu: the calls the platform makes ------------------------------------------

def _mem_get_info(device=None):
    import os

    page = os.sysconf("SC_PAGE_SIZE")
    return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page


npu = types.SimpleNamespace(
    device_count=lambda: 1,
    is_available=lambda: True,
    current_device=lambda: npu.selected,
    set_device=lambda index: setattr(npu, "selected", int(index.index if isinstance(index, torch.device) else index)),
    synchronize=lambda device=None: None,
    mem_get_info=_mem_get_info,
    get_device_name=lambda index=0: "simulated Ascend NPU (plain torch on CPU tensors)",
    selected=0,
)


# ---- host syncs ---------------------------------------------------------------------

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
