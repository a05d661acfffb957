"""NpuBackend's own code on the SIMULATED NPU (tests/npu_sim: a plain-torch
stand-in for torch_npu on CPU tensors, installed only in this process).

What this covers: the layouts, per-step metadata, masks, slot mapping, the
Q_S = 1 route and the capability declaration, against the operators'
documented rules and the pure-torch reference. What it does not: device
placement, the real CANN kernels, their numerics or speed. None of this is
an NPU run (docs/ascend.md).
"""

from __future__ import annotations

import sys
from pathlib import Path

import entry_point_site
import pytest
import torch

from paged.backends.base import AttentionMetadata
from paged.backends.npu import NpuBackend, layout
from paged.backends.reference import ReferenceBackend
from paged.core.conformance import kernel_checks as kc

SIM_DIR = Path(__file__).parent / "npu_sim"
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Paged attention stores the KV cache in"]
#: greedy bf16 on the simulated NPU may leave the float32 CPU engine's tokens
#: only where the CPU's top-2 logit margin there is below this (nats): bf16
#: keeps 8 mantissa bits, so 30 layers of rounded activations move a logit by
#: a few tenths at most on this model (measured: see docs/ascend.md)
MARGIN = 0.5


@pytest.fixture(scope="module")
def sim(tmp_path_factory):
    """The npu-sim platform reachable by name, the simulator installed."""
    site = tmp_path_factory.mktemp("npu_sim_site")
    entry_point_site.write_dist_info(SIM_DIR, site)
    sys.path[:0] = [str(site), str(SIM_DIR)]
    import paged_npu_sim
    from paged_npu_sim import torch_npu_sim

    assert paged_npu_sim.NpuSimPlatform().is_available().ok
    yield torch_npu_sim
    paged_npu_sim.uninstall()
    for p in (str(site), str(SIM_DIR)):
        sys.path.remove(p)


def _filled(be, case: kc.AttnCase):
    batch = kc.make_batch(case, be.dtype)
    return batch, kc.filled_cache(be, batch)


# ---- the Q_S = 1 path -----------------------------------------------------------

def test_one_token_prefill_goes_through_the_decode_call(sim):
    """Every prefill row one token (a 1-token chunk remainder, a full
    prefix-cache hit): the operator's incremental branch, with the decode
    call's arguments; equal to the reference."""
    case = kc.AttnCase(8, 2, 64, 128, (129, 1, 300), query_lens=(1, 1, 1), sliding_window=0)
    be = NpuBackend(8, 2, 64, 128, torch.bfloat16, "cpu")
    batch, kv = _filled(be, case)
    before = dict(sim.calls)
    got = kc.run_attention(be, batch, case, kv)
    assert sim.calls["npu_fused_infer_attention_score"] == before["npu_fused_infer_attention_score"] + 1
    ref = kc.run_attention(ReferenceBackend(8, 2, 64, 128, torch.bfloat16, "cpu"), batch, case)
    assert kc._rel_error(got, ref) < kc.TOLERANCE[torch.bfloat16]
    for window in (0, 7):  # the same through a step's metadata, decodes first, with and without a window
        be = NpuBackend(8, 2, 64, 128, torch.bfloat16, "cpu", sliding_window=window)
        ref_be = ReferenceBackend(8, 2, 64, 128, torch.bfloat16, "cpu", sliding_window=window)
        meta = be.build_metadata(_common(batch, num_decodes=1))
        assert meta.num_decodes == 3 and meta.prefill_q_lens == []
        new_k, new_v = torch.randn(2, 3, 2, 64).bfloat16()
        out = be.forward(batch.query, new_k, new_v, kc.filled_cache(be, batch), meta)
        want = ref_be.forward(batch.query, new_k, new_v, kc.filled_cache(ref_be, batch),
                              _common(batch, num_decodes=1))
        assert kc._rel_error(out, want) < kc.TOLERANCE[torch.bfloat16]


def test_the_simulator_refuses_what_the_operator_refuses(sim):
    """The old Q_S = 1 call (sparse_mode 3 with the 2048 mask) and the other
    documented rules fail on the simulator as on a 910B."""
    be = NpuBackend(8, 2, 64, 128, torch.bfloat16, "cpu")
    ((kc_, vc_),) = be.allocate_kv_cache(1, 4)
    q = torch.randn(2, 1, 8 * 64).bfloat16()
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    call = dict(block_table=table, actual_seq_lengths_kv=[5, 200], num_heads=8, num_key_value_heads=2,
                scale=0.125, input_layout="BSH", block_size=128)
    flat = be._flat_cache(kc_), be._flat_cache(vc_)
    sim.npu_fused_infer_attention_score(q, *flat, **call)  # the decode call: accepted
    bad = [(dict(sparse_mode=3, atten_mask=layout.causal_mask("cpu"), actual_seq_lengths=[1, 1]), "sparse_mode 0"),
           (dict(atten_mask=torch.zeros(2, 2048, 2048, dtype=torch.bool)), r"atten_mask \[B=2, KV_S"),
           (dict(block_table=table.long()), "block_table int32"),
           (dict(actual_seq_lengths_kv=None), "actual_seq_lengths_kv"),
           (dict(input_layout="TND"), "BSH")]
    for extra, needle in bad:
        with pytest.raises(sim.SimulatedNpuError, match=needle):
            sim.npu_fused_infer_attention_score(q, *flat, **(call | extra))
    q2 = torch.randn(2, 3, 8 * 64).bfloat16()
    small = torch.zeros(4, 16, 2 * 64).bfloat16()  # 16-token blocks, (blocks, block_size, Hkv*D)
    with pytest.raises(sim.SimulatedNpuError, match="multiple of 128"):
        sim.npu_fused_infer_attention_score(q2, small, small, **(call | dict(block_size=16, sparse_mode=3,
                                            atten_mask=layout.causal_mask("cpu"), actual_seq_lengths=[3, 3], actual_seq_lengths_kv=[5, 20])))
    with pytest.raises(sim.SimulatedNpuError, match="no padding slots"):
        sim.npu_scatter_pa_kv_cache(torch.zeros(1, 2, 64).bfloat16(), torch.zeros(1, 2, 64).bfloat16(),
                                    kc_, vc_, torch.tensor([-1]))


def _common(batch, num_decodes: int) -> AttentionMetadata:
    """One new token per sequence (its last position), decodes first."""
    bs = 128
    last = [n - 1 for n in batch.seq_lens.tolist()]
    slots = [int(batch.block_tables[i, p // bs]) * bs + p % bs for i, p in enumerate(last)]
    return AttentionMetadata(slot_mapping=torch.tensor(slots), query_start_loc=batch.query_start_loc,
                             seq_lens=batch.seq_lens, block_tables=batch.block_tables, num_decodes=num_decodes,
                             max_query_len=1, max_seq_len=max(last) + 1)
