"""bfloat16 prompt attention (prefill_attention_bf16, csrc_cpu/attention/
prompt_bf16_amx.cpp): what --linear-activations mixed-bf16 runs for prompt
rows on CPUs with AMX-BF16.

Its definition is softmax(bf16(q * scale) . bf16(k)) . bf16(v) with the
probabilities rounded to bfloat16 and float32 sums, so the oracle is that
product in float64 from the same rounded operands, within the rounding of
the probabilities (a convex combination of V rows whose weights move by
<= 2^-8 each); batch, chunk and thread-count invariance are bitwise, through
the conformance suite's own check with prefill routed to this kernel; the
layer stack bitwise the Python layers on a model whose head size it takes.
Skipped with the reason where the CPU has no AMX-BF16 (Zen 3, Zen 4)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from paged import _C_cpu as C
from test_layer_stack import LENGTHS, MAX_BLOCKS, step, tiny_config, tiny_weights
from test_mixed_activations import assert_stack_equals_python_on_mixed_steps, model_with

from paged.backends.cpu.attention import CpuBackend
from paged.backends.cpu import quant_linear as ql
from paged.core.conformance import kernel_checks as kc

pytestmark = pytest.mark.skipif(not C.bf16_prompt_attention_supported(),
                                reason="this CPU (or its OS, or PAGED_CPU_HIDE) offers no AMX-BF16 tiles")


def prefill_through(op: str) -> type:
    """A CpuBackend whose prefill_attention is its method ``op`` (a prompt
    kernel; decode unchanged), for the conformance suite's checks."""
    def prefill_attention(self, *args, **kwargs) -> None:
        getattr(self, op)(*args, **kwargs)
    return type(f"PrefillThrough_{op}", (CpuBackend,), {"prefill_attention": prefill_attention})


Bf16PromptBackend = prefill_through("prefill_attention_bf16")


def to_bf16(x: torch.Tensor) -> torch.Tensor:
    return x.float().bfloat16().double()


def reference(be, batch, case, kv, scale: float, rounding=to_bf16) -> torch.Tensor:
    """The definition in float64: q * scale, k, v through ``rounding`` (to
    bfloat16 here), exact softmax."""
    H, D, bs = case.num_heads, case.head_size, case.block_size
    G = H // case.num_kv_heads
    qsl = batch.query_start_loc.tolist()
    out = torch.empty(batch.query.shape, dtype=torch.float64)
    for s, n in enumerate(case.seq_lens):
        table = batch.block_tables[s]
        slots = torch.tensor([int(table[p // bs]) * bs + p % bs for p in range(n)])
        k, v = be.read_kv(kv[0], kv[1], slots)
        k, v = rounding(k), rounding(v)
        q = rounding(batch.query[qsl[s]:qsl[s + 1]].float() * scale)
        ql_ = q.shape[0]
        pos = torch.arange(n - ql_, n)
        keys = torch.arange(n)
        seen = keys[None, :] <= pos[:, None]
        if case.sliding_window:
            seen &= keys[None, :] > pos[:, None] - case.sliding_window
        for h in range(H):
            scores = (q[:, h] @ k[:, h // G].T).masked_fill(~seen, -math.inf)
            out[qsl[s]:qsl[s + 1], h] = torch.softmax(scores, -1) @ v[:, h // G]
    return out


CASES = [
    kc.AttnCase(9, 3, 64, 16, (300,), query_lens=(300,)),  # the default model's shape, one whole prompt
    kc.AttnCase(9, 3, 64, 128, (700, 45, 260, 33), query_lens=(33, 45, 1, 5)),  # chunks over cached prefixes
    kc.AttnCase(8, 2, 128, 32, (513, 90), query_lens=(200, 90), sliding_window=100),
    kc.AttnCase(4, 4, 96, 16, (77,), query_lens=(77,)),  # D = 96: a last pass of 32 dims
    kc.AttnCase(8, 2, 32, 48, (1030,), query_lens=(17,)),  # many steps, few query vectors
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"h{c.num_heads}/{c.num_kv_heads}d{c.head_size}")
def test_matches_the_bf16_definition_in_float64(case, dtype):
    be = kc.make_backend(Bf16PromptBackend, case, "cpu", dtype)
    batch = kc.make_batch(case, dtype)
    kv = kc.filled_cache(be, batch)
    got = kc.run_attention(be, batch, case, kv).double()
    want = reference(be, batch, case, kv, be.scale)
    vmax = max(float(kv[1].float().abs().max()), 1.0)
    tol = 2.0 ** -7 * vmax + (2.0 ** -8 * vmax if dtype != torch.float32 else 0.0)  # + the output's rounding
    assert (got - want).abs().max().item() <= tol
    # and it is not the float32 kernel (q and k rounded to bfloat16 move the scores)
    f32 = kc.run_attention(kc.make_backend(CpuBackend, case, "cpu", dtype), batch, case, kv).double()
    assert not torch.equal(f32, got)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_batch_chunk_and_thread_invariance_is_bitwise(dtype):
    """The conformance suite's invariance check (alone vs batched, batch
    order, chunked prefill, 1 vs 2 threads), prefill through this kernel."""
    assert kc.check_batch_invariance(Bf16PromptBackend, "cpu", dtype) == 0.0


def test_argument_errors():
    case = kc.AttnCase(4, 2, 64, 16, (40,), query_lens=(40,))
    batch = kc.make_batch(case, torch.float32)
    for kv_dtype, head, match in ((torch.int8, 64, r"key_cache: expected float32, bfloat16 or float16"),
                                  (torch.float32, 48, r"head_size \(key_cache dim 3\): expected a multiple of 32")):
        be = CpuBackend(4, 2, head, 16, torch.float32, "cpu", kv_cache_dtype=kv_dtype)
        k, v = be.allocate_kv_cache(1, batch.num_blocks)[0]
        q = torch.zeros(40, 4, head)
        with pytest.raises(ValueError, match=match):
            be.prefill_attention_bf16(torch.empty_like(q), q, k, v, batch.query_start_loc, batch.seq_lens,
                                      batch.block_tables, be.scale)
    be = CpuBackend(4, 2, 64, 16, torch.float32, "cpu")
    k, v = be.allocate_kv_cache(1, batch.num_blocks)[0]
    with pytest.raises(ValueError, match=r"query_start_loc"):  # prefill_attention's own checks
        be.prefill_attention_bf16(torch.empty(40, 4, 64), torch.zeros(40, 4, 64), k, v,
                                  torch.tensor([0, 39], dtype=torch.int32), batch.seq_lens, batch.block_tables,
                                  be.scale)


def check_prompt_attention_route(mode: str, kind: str, op: str, config, monkeypatch) -> None:
    """A ``mode`` model: its backend's prompt_attention is ``kind`` and routes
    prompt rows to its method ``op``, the C++ stack does the same (bitwise the
    Python layers, decodes and prompts in one step), the route matters (the
    shared float32 kernel gives other bits), and unmarked rows keep the
    shared kernel, as the linears keep int8x2."""
    weights = tiny_weights(config)
    model, backend = model_with(mode, config, weights)
    fresh = lambda: backend.allocate_kv_cache(config.num_layers, len(LENGTHS) * MAX_BLOCKS)  # noqa: E731
    assert backend.prompt_attention == kind
    assert model.layer_stack is not None and backend.prompt_attention_op(fresh()[0][0]) == getattr(backend, op)
    assert_stack_equals_python_on_mixed_steps(model, backend, config, monkeypatch)
    rng = np.random.default_rng(5)
    tokens = [rng.integers(0, 96, size=n + 12).tolist() for n in LENGTHS]
    ids, pos, meta = step(tokens, [(0, 0, 3), (1, 0, 17), (3, 0, 20)], 0)
    meta.first_prompt_row = 0
    monkeypatch.setenv("PAGED_LAYER_STACK", "0")
    routed = model(ids, pos, fresh(), meta)
    backend.prompt_attention = "float32"
    assert not torch.equal(model(ids, pos, fresh(), meta), routed)
    backend.prompt_attention = kind
    meta.first_prompt_row = None
    unmarked = model(ids, pos, fresh(), meta)
    backend.prompt_attention = "float32"
    assert torch.equal(model(ids, pos, fresh(), meta), unmarked)


@pytest.mark.skipif(not ql.bf16_prompt_supported(), reason="linear kernels below the avx512 level: no mixed-bf16")
def test_stack_equals_python_layers_with_bf16_prompt_attention(monkeypatch):
    """mixed-bf16 with a head size the kernel takes (32): check_prompt_attention_route."""
    check_prompt_attention_route("mixed-bf16", "bf16", "prefill_attention_bf16", tiny_config(head_dim=32), monkeypatch)
