"""CUDA backend: what runs here (module import without a GPU, platform
detection, boundary validation, budget arithmetic) and, where a GPU is
visible, the kernels against the pure-torch ReferenceBackend (the oracle)
plus the shared kernel checks of core/conformance/kernel_checks.py."""

from __future__ import annotations

import inspect
import itertools
import math
import os
import shutil

import pytest
import torch

from paged.backends.base import AttentionMetadata
from paged.backends.reference.attention import ReferenceBackend
from paged.platforms import PlatformUnavailable, get_platform
from paged.platforms.cuda import CudaPlatform, kv_cache_budget

HAS_GPU = torch.cuda.is_available()
needs_gpu = pytest.mark.skipif(not HAS_GPU, reason="no CUDA device visible (torch.cuda.is_available() is False)")
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
TOL = {torch.bfloat16: 2e-2, torch.float16: 2e-3, torch.float32: 1e-4}
# the tensor-core prefill rounds the softmax weights to the dtype before P V
PREFILL_TOL = {torch.bfloat16: 3e-2, torch.float16: 4e-3, torch.float32: 1e-4}
HEAD_SIZES = [64, 80, 96, 112, 128, 256]


def _ops():
    try:
        from paged import _C_cuda
    except ImportError as e:
        if shutil.which("nvcc"):
            pytest.fail(f"nvcc is on PATH but paged._C_cuda did not build/import: {e}")
        pytest.skip(f"paged._C_cuda not built (no nvcc here): {e}")
    return _C_cuda


# -- here, without a GPU ---------------------------------------------------------
def test_module_imports_and_reports_archs():
    ops = _ops()
    want = os.environ.get("PAGED_CUDA_ARCHS", "80;90").replace(";", ",")
    assert ops.built_archs == want


@pytest.mark.skipif(HAS_GPU, reason="checks the no-GPU path")
def test_no_gpu_is_reported_not_raised():
    ops = _ops()
    assert ops.device_count() == 0
    assert ops.compute_capability(0) == -1
    p = CudaPlatform()
    a = p.is_available()
    assert not a.ok and a.reason.startswith("no CUDA device visible (torch.cuda.is_available() is False")
    assert p.device_count() == 0
    with pytest.raises(PlatformUnavailable, match="no CUDA device visible"):
        get_platform("cuda")
    report = p.env_report()
    assert report["available"] is False and report["compiled"]["_C_cuda"] is True
    with pytest.raises(RuntimeError, match="DeviceArena"):
        ops.DeviceArena(1 << 20, 0)


def test_head_sizes_agree_with_the_compiled_kernels():
    from paged.backends.cuda.attention import SUPPORTED_HEAD_SIZES

    assert tuple(_ops().head_sizes) == SUPPORTED_HEAD_SIZES == tuple(HEAD_SIZES)


def test_platform_attributes():
    p = CudaPlatform()
    assert (p.name, p.device_type, p.dist_backend) == ("cuda", "cuda", "nccl")
    from paged.backends.cuda.attention import CudaBackend

    assert p.worker_cls()(p).attention_backend_cls() is CudaBackend


def test_boundary_rejects_host_tensors_and_bad_shapes():
    ops = _ops()
    kc = torch.zeros(4, 2, 16, 64, dtype=torch.float16)
    key = torch.zeros(3, 2, 64, dtype=torch.float16)
    slots = torch.zeros(3, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"key_cache: expected a CUDA tensor \(DLPack device type 2\), got device type 1"):
        ops.reshape_and_cache(key, key, kc, kc, slots, 0)
    with pytest.raises(ValueError, match=r"value_caches: expected one per layer of key_caches \(1\), got 0"):
        ops.copy_blocks([kc], [], torch.zeros(0, 2, dtype=torch.int64), 0)


def test_swap_blocks_host_side_checks():
    ops = _ops()
    src, dst = torch.zeros(4, 2, 16, 64), torch.zeros(3, 2, 16, 64)
    with pytest.raises(IndexError, match=r"block_mapping\[1, 1\]: expected a destination block id in \[0, 3\), got 3"):
        ops.swap_blocks(src, dst, torch.tensor([[0, 0], [1, 3]]), 0)
    with pytest.raises(ValueError, match=r"dst_cache: expected dim 3 = 64, got shape \(3, 2, 16, 32\)"):
        ops.swap_blocks(src, torch.zeros(3, 2, 16, 32), torch.tensor([[0, 0]]), 0)
    with pytest.raises(ValueError, match="block_mapping: expected dtype int64, got int32"):
        ops.swap_blocks(src, dst, torch.tensor([[0, 0]], dtype=torch.int32), 0)
    if not HAS_GPU:  # valid arguments reach the CUDA runtime, whose error surfaces as RuntimeError
        with pytest.raises(RuntimeError, match="swap_blocks: CUDA error"):
            ops.swap_blocks(src, dst, torch.tensor([[0, 0]]), 0)


def test_block_pool_is_the_shared_accounting():
    """Block ids never touch device memory: CUDA keeps the host's one
    accounting (docs/architecture.md); _C_cuda binds only kernels and the arena."""
    ops = _ops()
    from paged import _C_blocks
    from paged.core.engine.kv_cache_manager import shared_block_pool

    assert shared_block_pool() == (_C_blocks.BlockPool, _C_blocks.hash_block)
    assert not hasattr(ops, "BlockPool") and hasattr(ops, "DeviceArena")


def test_id_checks_run_once_per_distinct_input():
    from paged.backends.cuda.id_checks import CheckedOnce

    calls = []
    once = CheckedOnce()
    tables = torch.arange(12, dtype=torch.int32).view(3, 4)
    for view in (tables, tables, tables[:3], tables[:2], tables[:2]):  # every layer of a step
        once.run("t", (view,), (16,), lambda: calls.append(1))
    assert len(calls) == 2  # the full table, then the [:2] slice
    tables[0, 0] = 5  # modified in place: checked again
    once.run("t", (tables[:2],), (16,), lambda: calls.append(1))
    once.run("t", (tables[:2],), (17,), lambda: calls.append(1))  # other cache size
    once.run("t", (tables.clone()[:2],), (17,), lambda: calls.append(1))  # new tensor, same values
    assert len(calls) == 5

    def fails():
        raise IndexError("bad")
    for _ in range(2):  # a failing check is never remembered
        with pytest.raises(IndexError):
            once.run("t", (tables,), (1,), fails)


def test_decode_split_count_depends_on_length_only():
    ops = _ops()
    p = ops.split_partition
    for blocks, bs, window in [(1, 16, 0), (32, 16, 0), (33, 16, 0), (100, 128, 0), (100, 128, 700), (4, 16, 4096)]:
        keys = blocks * bs if not window else min(blocks * bs, window)
        assert ops.decode_max_splits(blocks, bs, window) == math.ceil(keys / p)


def test_kv_cache_budget_arithmetic():
    total, used = 80 * 2**30, 20 * 2**30
    assert kv_cache_budget(total, used, 0.9) == int(0.9 * total) - used
    assert kv_cache_budget(total, used, 0.5, requested=2**30) == 2**30
    with pytest.raises(ValueError, match="--kv-cache-memory 60.00 GiB exceeds the 52.00 GiB"):
        kv_cache_budget(total, used, 0.9, requested=60 * 2**30)
    with pytest.raises(ValueError, match="no room for the KV cache"):
        kv_cache_budget(total, used, 0.25)
    for bad in (0, 1.5, -0.1, "0.9"):
        with pytest.raises(ValueError, match="--gpu-memory-utilization must be in"):
            kv_cache_budget(total, used, bad)


def test_backend_takes_every_argument_of_the_base_constructor():
    # the worker builds backends with the base's keywords (a new one once broke CUDA unnoticed)
    from paged.backends.base import AttentionBackend
    from paged.backends.cuda.attention import CudaBackend

    base = inspect.signature(AttentionBackend.__init__).parameters
    ours = inspect.signature(CudaBackend.__init__).parameters
    assert [n for n in base if n not in ours] == []


def test_backend_rejects_unsupported_shapes():
    from paged.backends.cuda.attention import CudaBackend

    with pytest.raises(ValueError, match=r"head_size \(cuda\): expected one of 64, 80, 96, 112, 128, 256, got 72"):
        CudaBackend(8, 2, 72, 16, torch.float16, "cuda")
    with pytest.raises(ValueError, match=r"kv_cache_dtype \(cuda\): expected the model dtype torch.float16, "
                                         r"got torch.int8"):
        CudaBackend(8, 2, 64, 16, torch.float16, "cuda", kv_cache_dtype=torch.int8)
    with pytest.raises(ValueError, match=r"device \(cuda backend\): expected a cuda device, got cpu"):
        CudaBackend(8, 2, 64, 16, torch.float16, "cpu")


# -- on a GPU: against the reference backend -------------------------------------
def _pair(dtype, head_size=128, block_size=16, heads=(8, 2), window=0, check_ids=True):
    from paged.backends.cuda.attention import CudaBackend

    args = (heads[0], heads[1], head_size, block_size, dtype, "cuda:0")
    return CudaBackend(*args, sliding_window=window, check_ids=check_ids), ReferenceBackend(*args, sliding_window=window)


def _filled_cache(be, num_blocks, gen):
    shape = be.kv_cache_shape(num_blocks)
    return [torch.randn(shape, generator=gen).to(be.dtype).cuda() for _ in range(2)]


def _host_tables(lens, block_size, num_blocks, gen):
    """Block tables [S, longest's blocks] whose used entries are distinct ids
    of a pool of ``num_blocks`` (the rest padding, -1), and the lengths."""
    used = [math.ceil(n / block_size) for n in lens]
    if sum(used) > num_blocks:
        raise ValueError(f"num_blocks: expected at least the {sum(used)} blocks the sequences use, got {num_blocks}")
    perm = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    tables = torch.full((len(lens), max(used)), -1, dtype=torch.int32)
    for i, at in enumerate(itertools.accumulate([0] + used[:-1])):
        tables[i, :used[i]] = perm[at:at + used[i]]
    return tables, torch.tensor(lens, dtype=torch.int32)


def _tables(lens, block_size, num_blocks, gen):
    return tuple(t.cuda() for t in _host_tables(lens, block_size, num_blocks, gen))


def test_gpu_tests_block_tables_fit_their_pools():
    """The GPU tests' tables (they cannot run here): each sequence's used
    blocks distinct, padding past them; the helper used to cut
    max-blocks x sequences ids out of pools smaller than that, failing every
    GPU test before any kernel ran."""
    gen = torch.Generator().manual_seed(0)
    lens = [1, 17, 511, 512, 513, 1500, 3000]
    tables, seq_lens = _host_tables(lens, 16, sum(math.ceil(n / 16) for n in lens) + 8, gen)
    used = [math.ceil(n / 16) for n in lens]
    ids = torch.cat([tables[i, :u] for i, u in enumerate(used)])
    assert tables.shape == (7, 188) and ids.unique().numel() == ids.numel() == sum(used)
    assert all((tables[i, u:] == -1).all() for i, u in enumerate(used)) and seq_lens.tolist() == lens
    with pytest.raises(ValueError, match="expected at least the 101 blocks the sequences use, got 100"):
        _host_tables([1500, 100], 16, 100, gen)


@needs_gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_size", HEAD_SIZES)
@pytest.mark.parametrize("block_size,heads,window", [(16, (8, 2), 0), (32, (8, 8), 0), (128, (32, 2), 0), (16, (12, 4), 300)])
def test_decode_matches_reference(dtype, head_size, block_size, heads, window):
    gen = torch.Generator().manual_seed(0)
    cuda, ref = _pair(dtype, head_size, block_size, heads, window)
    lens = [1, 17, 511, 512, 513, 1500, 3000]  # across the split-K partition boundary
    num_blocks = sum(math.ceil(n / block_size) for n in lens) + 8
    kc, vc = _filled_cache(cuda, num_blocks, gen)
    tables, seq_lens = _tables(lens, block_size, num_blocks, gen)
    q = torch.randn(len(lens), heads[0], head_size, generator=gen).to(dtype).cuda()
    out, want = torch.empty_like(q), torch.empty_like(q)
    cuda.paged_attention(out, q, kc, vc, tables, seq_lens, cuda.scale, window)
    ref.paged_attention(want, q, kc, vc, tables, seq_lens, ref.scale, window)
    torch.testing.assert_close(out.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])


@needs_gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_size,window", [(d, 0) for d in HEAD_SIZES] + [(128, 40), (80, 100)])
def test_prefill_with_cached_prefix_matches_reference(dtype, head_size, window):
    # float16/bfloat16 run the tensor-core kernel (P rounded to the dtype, as FlashAttention-2)
    gen = torch.Generator().manual_seed(1)
    cuda, ref = _pair(dtype, head_size, 16, (8, 2), window)
    # fresh prompt, prefix hit, one-token chunk, full, and one over many 64-row tiles and key tiles
    lens, qlens = [5, 70, 300, 64, 400], [5, 33, 1, 64, 230]
    num_blocks = 128  # the sequences use 54 blocks
    kc, vc = _filled_cache(cuda, num_blocks, gen)
    tables, seq_lens = _tables(lens, 16, num_blocks, gen)
    qsl = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32).cuda()
    q = torch.randn(sum(qlens), 8, head_size, generator=gen).to(dtype).cuda()
    out, want = torch.empty_like(q), torch.empty_like(q)
    cuda.prefill_attention(out, q, kc, vc, qsl, seq_lens, tables, cuda.scale, window)
    ref.prefill_attention(want, q, kc, vc, qsl, seq_lens, tables, ref.scale, window)
    tol = PREFILL_TOL[dtype]
    torch.testing.assert_close(out.float(), want.float(), atol=tol, rtol=tol)


@needs_gpu
def test_decode_is_batch_invariant():
    gen = torch.Generator().manual_seed(2)
    cuda, _ = _pair(torch.bfloat16)
    lens = [2000, 30, 1100]
    kc, vc = _filled_cache(cuda, 256, gen)
    tables, seq_lens = _tables(lens, 16, 256, gen)
    q = torch.randn(3, 8, 128, generator=gen).to(torch.bfloat16).cuda()
    out = torch.empty_like(q)
    cuda.paged_attention(out, q, kc, vc, tables, seq_lens, cuda.scale, 0)
    for i in range(3):
        alone = torch.empty_like(q[i:i + 1])
        width = math.ceil(lens[i] / 16)
        cuda.paged_attention(alone, q[i:i + 1], kc, vc, tables[i:i + 1, :width].contiguous(), seq_lens[i:i + 1],
                             cuda.scale, 0)
        assert torch.equal(alone[0], out[i])


@needs_gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_cache_ops_match_reference(dtype):
    gen = torch.Generator().manual_seed(3)
    cuda, ref = _pair(dtype, 64, 16, (4, 2))
    caches = cuda.allocate_kv_cache(num_layers=2, num_blocks=12)
    assert all(t.is_cuda and t.shape == (12, 2, 16, 64) and not t.any() for kv in caches for t in kv)
    ref_caches = [(k.clone(), v.clone()) for k, v in caches]
    key = torch.randn(20, 2, 64, generator=gen).to(dtype).cuda()
    value = torch.randn(20, 2, 64, generator=gen).to(dtype).cuda()
    slots = torch.randperm(12 * 16, generator=gen)[:20]
    slots[3] = -1  # padding
    slots = slots.cuda()
    for (kc, vc), (rk, rv) in zip(caches, ref_caches):
        cuda.reshape_and_cache(key, value, kc, vc, slots)
        ref.reshape_and_cache(key, value, rk, rv, slots)
    assert all(torch.equal(a, b) for kv, rkv in zip(caches, ref_caches) for a, b in zip(kv, rkv))
    assert all(torch.equal(a, b) for a, b in zip(cuda.read_kv(*caches[0], slots), ref.read_kv(*ref_caches[0], slots)))
    # the kernel (disjoint sources and destinations, mapping on the device), then the overlap fallback
    for mapping in (torch.tensor([[1, 5], [0, 7], [3, 10]]).cuda(), torch.tensor([[1, 4], [0, 1], [4, 2]])):
        cuda.copy_blocks([k for k, _ in caches], [v for _, v in caches], mapping)
        ref.copy_blocks([k for k, _ in ref_caches], [v for _, v in ref_caches], mapping)
        assert all(torch.equal(a, b) for kv, rkv in zip(caches, ref_caches) for a, b in zip(kv, rkv))
    host = torch.zeros((6, 2, 16, 64), dtype=dtype).pin_memory()
    cuda.swap_blocks(caches[0][0], host, torch.tensor([[5, 0], [7, 4]]))
    back = caches[1][1]
    cuda.swap_blocks(host, back, torch.tensor([[4, 9], [0, 11]]))
    torch.cuda.synchronize()
    assert torch.equal(host[0], caches[0][0][5].cpu()) and torch.equal(host[4], caches[0][0][7].cpu())
    assert torch.equal(back[9], caches[0][0][7]) and torch.equal(back[11], caches[0][0][5])


@needs_gpu
def test_forward_mixed_batch_matches_reference():
    gen = torch.Generator().manual_seed(4)
    cuda, ref = _pair(torch.float16, 128, 16, (8, 2))
    kc, vc = _filled_cache(cuda, 64, gen)
    rk, rv = kc.clone(), vc.clone()
    lens, qlens = [40, 700, 20], [1, 1, 20]
    tables, seq_lens = _tables(lens, 16, 64, gen)
    qsl = torch.tensor([0, 1, 2, 22], dtype=torch.int32).cuda()
    slots = torch.cat([tables[i, torch.arange(n - q, n) // 16].long().cpu() * 16 + torch.arange(n - q, n) % 16
                       for i, (n, q) in enumerate(zip(lens, qlens))]).cuda()
    meta = AttentionMetadata(slots, qsl, seq_lens, tables, num_decodes=2, max_query_len=20, max_seq_len=700)
    q = torch.randn(22, 8, 128, generator=gen).half().cuda()
    k, v = (torch.randn(22, 2, 128, generator=gen).half().cuda() for _ in range(2))
    out = cuda.forward(q, k, v, (kc, vc), meta)
    want = ref.forward(q, k, v, (rk, rv), meta)
    assert torch.equal(kc, rk) and torch.equal(vc, rv)
    torch.testing.assert_close(out.float(), want.float(), atol=2e-3, rtol=2e-3)


@needs_gpu
def test_per_layer_windows_match_reference():
    """Layers with their own sliding window (core/models/layer_attention.py)
    on one CudaBackend sized for none: one step's metadata, each layer's
    forward equal to the reference backend made for its window."""
    from paged.core.models.layer_attention import layer_attention

    gen = torch.Generator().manual_seed(5)
    cuda, _ = _pair(torch.float16, 128, 16, (8, 2))
    lens, qlens = [1500, 700, 90], [1, 1, 30]
    tables, seq_lens = _tables(lens, 16, 320, gen)  # 94 columns x 3 sequences
    qsl = torch.tensor([0, 1, 2, 32], dtype=torch.int32).cuda()
    slots = torch.cat([tables[i, torch.arange(n - q, n) // 16].long().cpu() * 16 + torch.arange(n - q, n) % 16
                       for i, (n, q) in enumerate(zip(lens, qlens))]).cuda()
    common = AttentionMetadata(slots, qsl, seq_lens, tables, num_decodes=2, max_query_len=30, max_seq_len=1500)
    cuda.num_blocks = 320
    meta = cuda.build_metadata(common)
    q = torch.randn(32, 8, 128, generator=gen).half().cuda()
    k, v = (torch.randn(32, 2, 128, generator=gen).half().cuda() for _ in range(2))
    for window in (0, 600, 64, 1):
        kc, vc = _filled_cache(cuda, 320, gen)
        rk, rv = kc.clone(), vc.clone()
        out = layer_attention(cuda, window, cuda.scale).forward(q, k, v, (kc, vc), meta)
        ref = ReferenceBackend(8, 2, 128, 16, torch.float16, "cuda:0", sliding_window=window)
        want = ref.forward(q, k, v, (rk, rv), common)
        torch.testing.assert_close(out.float(), want.float(), atol=2e-3, rtol=2e-3)


@needs_gpu
def test_bad_block_ids():
    cuda, _ = _pair(torch.float16, 64, 16, (4, 2), check_ids=True)
    kc = torch.zeros(cuda.kv_cache_shape(4), dtype=torch.float16, device="cuda")
    q = torch.zeros(1, 4, 64, dtype=torch.float16, device="cuda")
    tables = torch.tensor([[9]], dtype=torch.int32, device="cuda")
    lens = torch.tensor([5], dtype=torch.int32, device="cuda")
    with pytest.raises(IndexError, match=r"block_tables\[0, 0\]: expected a block id in \[0, 4\), got 9"):
        cuda.paged_attention(torch.empty_like(q), q, kc, kc, tables, lens, 1.0, 0)
    tables[0, 0] = 2  # modified in place: checked again, now valid
    cuda.paged_attention(torch.empty_like(q), q, kc, kc, tables, lens, 1.0, 0)
    tables[0, 0] = 9
    cuda.check_ids = False  # the device-side guard: no fault, finite output
    out = torch.empty_like(q)
    cuda.paged_attention(out, q, kc, kc, tables, lens, 1.0, 0)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()


@needs_gpu
def test_misaligned_cuda_view_is_an_error_and_the_context_survives():
    """A view 2 bytes off a 16-byte boundary is a ValueError at the boundary
    (alignment.h), not a misaligned-address fault: the next call works."""
    cuda, _ = _pair(torch.float16, 64, 16, (4, 2))
    kc = torch.zeros(cuda.kv_cache_shape(4), dtype=torch.float16, device="cuda")
    flat = torch.zeros(1 + 3 * 2 * 64, dtype=torch.float16, device="cuda")
    key = flat[1:].view(3, 2, 64)
    slots = torch.arange(3, dtype=torch.int64, device="cuda")
    with pytest.raises(ValueError, match="key: expected a data pointer aligned to 16 bytes"):
        cuda.reshape_and_cache(key, key, kc, kc, slots)
    cuda.reshape_and_cache(key.clone(), key.clone(), kc, kc, slots)
    torch.cuda.synchronize()


@needs_gpu
def test_decode_launched_with_too_few_partitions_writes_nan():
    """max_splits comes from the host's lengths; a launch that would not
    cover a sequence writes NaN for it, never a softmax over part of its keys."""
    gen = torch.Generator().manual_seed(5)
    cuda, _ = _pair(torch.float16, 64, 16, (4, 2))
    kc, vc = _filled_cache(cuda, 128, gen)
    tables, lens = _tables([1500, 100], 16, 128, gen)
    q = torch.randn(2, 4, 64, generator=gen).half().cuda()
    out = torch.empty_like(q)
    split_out, split_max_sum = cuda.split_workspace(2, 2)
    from torch.utils.dlpack import to_dlpack as d

    from paged import _C_cuda

    _C_cuda.paged_attention(d(out), d(q), d(kc), d(vc), d(tables), d(lens), cuda.scale, 0, d(split_out),
                            d(split_max_sum), 2, torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    assert torch.isnan(out[0]).all() and torch.isfinite(out[1]).all()  # 1500 tokens need 3 partitions


@needs_gpu
def test_runner_step_sizes_the_decode_by_its_own_lengths():
    """Through the model runner's path (host arrays attached): the split
    count is the longest decode's, and the output equals the reference."""
    from paged.core.engine.model_runner import StepMetadata, to_device
    from paged.core.engine.model_runner import HostBatch
    import numpy as np

    gen = torch.Generator().manual_seed(6)
    cuda, ref = _pair(torch.bfloat16, 128, 16, (8, 2))
    kc, vc = _filled_cache(cuda, 256, gen)
    rk, rv = kc.clone(), vc.clone()
    lens = [30, 1100, 7]
    tables, seq_lens = _tables(lens, 16, 256, gen)
    t_host = tables.cpu().numpy()
    pos = np.array([n - 1 for n in lens])
    slots = t_host[np.arange(3), pos // 16].astype(np.int64) * 16 + pos % 16
    b = HostBatch(np.zeros(3, dtype=np.int64), pos, slots, np.arange(4, dtype=np.int32),
                  np.array(lens, dtype=np.int32), t_host, 3, np.arange(3), 3)
    t = to_device({"slot_mapping": slots, "query_start_loc": b.query_start_loc, "seq_lens": b.seq_lens,
                   "block_tables": t_host}, torch.device("cuda", 0))
    common = StepMetadata(**t, num_decodes=3, max_query_len=1, max_seq_len=1100, host=b)
    cuda.num_blocks = 256
    meta = cuda.build_metadata(common)
    assert meta.decode_splits == 3
    q = torch.randn(3, 8, 128, generator=gen).bfloat16().cuda()
    k, v = (torch.randn(3, 2, 128, generator=gen).bfloat16().cuda() for _ in range(2))
    out = cuda.forward(q, k, v, (kc, vc), meta)
    want = ref.forward(q, k, v, (rk, rv), common)
    torch.testing.assert_close(out.float(), want.float(), atol=TOL[torch.bfloat16], rtol=TOL[torch.bfloat16])


# -- the shared kernel checks (core/conformance/kernel_checks.py) -------------------
def _kernel_checks():
    try:
        from paged.core.conformance import kernel_checks as kc
    except ImportError:
        return []
    return sorted((n, f) for n, f in vars(kc).items()
                  if n.startswith("check_") and callable(f) and getattr(f, "__module__", "") == kc.__name__)


@needs_gpu
@pytest.mark.parametrize("name,fn", _kernel_checks() or [pytest.param("none", None, marks=pytest.mark.skip(
    reason="core/conformance/kernel_checks.py is not there yet"))])
@pytest.mark.parametrize("dtype", DTYPES)
def test_shared_kernel_checks(name, fn, dtype):
    from paged.backends.cuda.attention import CudaBackend

    params = inspect.signature(fn).parameters
    for head_size in (64, 128) if "head_size" in params else (None,):
        kwargs = {"head_size": head_size, "quick": True}
        fn(CudaBackend, torch.device("cuda", 0), dtype, **{k: v for k, v in kwargs.items() if k in params and v is not None})
