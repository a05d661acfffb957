"""Tensor-parallel sharding math (core/engine/distributed/sharding.py), checked
against the unsharded model's matmuls: every rank's output rows of every
projection (QKV, gate/up, and o_proj / down over the gathered full input)
concatenate to the full output, the vocab-parallel embedding's per-rank
parts sum to the full lookup; packed GGUF weights are sliced by rows and
dequantize to the dense slices. The model-level check (a sharded model's
hidden states bitwise equal to one process's) is tests/test_tensor_parallel_bitwise.py."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import quants as gguf_quants

from paged.core.models.config import ModelConfig
from paged.core.engine.distributed.parallel_ops import TensorParallelOps
from paged.core.engine.distributed.sharding import local_config, plan_shards, rows, shard_weights, split_even, split_heads
from paged.core.models.loaders.packed import PackedBlocks


def tiny_config(**kw) -> ModelConfig:
    base = dict(architecture="llama", vocab_size=101, hidden_size=64, intermediate_size=160, num_layers=2,
                num_heads=9, num_kv_heads=3, head_dim=8, qkv_bias=True)
    base.update(kw)
    return ModelConfig(**base)


def random_weights(c: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    from paged.core.models.llama import expected_weight_shapes

    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(shape, generator=g) for n, shape in expected_weight_shapes(c).items()}


def test_split_even_puts_the_larger_parts_first():
    assert split_even(3, 2) == [(0, 2), (2, 3)]
    assert split_even(9, 3) == [(0, 3), (3, 6), (6, 9)]
    assert split_even(2, 3) == [(0, 1), (1, 2), (2, 2)]


def test_heads_split_by_whole_kv_groups_evenly_or_not():
    # the default model: 9 query heads, 3 KV heads
    assert split_heads(9, 3, 2) == [((0, 6), (0, 2)), ((6, 9), (2, 3))]
    assert split_heads(9, 3, 3) == [((0, 3), (0, 1)), ((3, 6), (1, 2)), ((6, 9), (2, 3))]
    assert split_heads(9, 3, 1) == [((0, 9), (0, 3))]


@pytest.mark.parametrize("world_size", [4, 5, 6, 9])
def test_more_ranks_than_kv_heads_replicates_each_kv_head_within_its_group(world_size):
    parts = split_heads(9, 3, world_size)
    assert len(parts) == world_size
    covered = [h for (q0, q1), _ in parts for h in range(q0, q1)]
    assert covered == list(range(9))  # every query head exactly once, in order
    for (q0, q1), (k0, k1) in parts:
        assert k1 - k0 == 1 and q1 > q0
        assert all(h // 3 == k0 for h in range(q0, q1))  # a query head's rank holds its KV head


def test_more_ranks_than_query_heads_is_a_clear_error():
    with pytest.raises(ValueError, match="tensor_parallel_size: expected at most the model's 9 query heads"):
        split_heads(9, 3, 10)


def test_intermediate_is_split_in_whole_quantization_blocks():
    shards = plan_shards(tiny_config(), 2)
    assert [s.inter for s in shards] == [(0, 96), (96, 160)]  # 5 blocks of 32: 3 + 2
    assert [s.vocab for s in shards] == [(0, 51), (51, 101)]
    assert [s.hidden for s in shards] == [(0, 32), (32, 64)]
    assert shards[0].vocab_sizes == (51, 50) and shards[1].inter_sizes == (96, 64)
    assert shards[0].attn_sizes == (6 * 8, 3 * 8) and shards[0].hidden_sizes == (32, 32)
    lc = local_config(tiny_config(), shards[1])
    assert (lc.num_heads, lc.num_kv_heads, lc.intermediate_size, lc.vocab_size) == (3, 1, 64, 50)


def _qkv_out(w: dict, c: ModelConfig, p: str, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(x @ w[p + n + "_proj.weight"].T + w[p + n + "_proj.bias"] for n in "qkv")


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_sharded_linears_equal_the_unsharded_ones(world_size):
    c = tiny_config()
    w = random_weights(c)
    x = torch.randn(5, c.hidden_size, dtype=torch.float64)
    w64 = {n: t.double() for n, t in w.items()}
    p = "model.layers.1."
    full_q, full_k, full_v = _qkv_out(w64, c, p + "self_attn.", x)
    d = c.head_dim
    attn = torch.randn(5, c.num_heads * d, dtype=torch.float64)
    inter = torch.randn(5, c.intermediate_size, dtype=torch.float64)
    o_parts, down_parts, gate_parts = [], [], []
    for shard in plan_shards(c, world_size):
        sw = shard_weights(w64, c, shard)
        q, k, v = _qkv_out(sw, c, p + "self_attn.", x)
        (q0, q1), (k0, k1) = shard.q_heads, shard.kv_heads
        # column-parallel: this rank's heads of the full output (float64:
        # equal to rounding, the BLAS blocking depends on the row count)
        close = dict(rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(q, full_q[:, q0 * d:q1 * d], **close)
        torch.testing.assert_close(k, full_k[:, k0 * d:k1 * d], **close)
        torch.testing.assert_close(v, full_v[:, k0 * d:k1 * d], **close)
        gate_parts.append(x @ sw[p + "mlp.gate_proj.weight"].T)
        # output projections: this rank's output rows over the gathered full input
        o_parts.append(attn @ sw[p + "self_attn.o_proj.weight"].T)
        down_parts.append(inter @ sw[p + "mlp.down_proj.weight"].T)
    for parts, want in ((gate_parts, x @ w64[p + "mlp.gate_proj.weight"].T),
                        (o_parts, attn @ w64[p + "self_attn.o_proj.weight"].T),
                        (down_parts, inter @ w64[p + "mlp.down_proj.weight"].T)):
        torch.testing.assert_close(torch.cat(parts, dim=1), want, rtol=1e-12, atol=1e-12)


class _LocalSum:
    """Collectives of one rank seen alone: all_reduce returns its own part
    (the test sums the parts of every rank itself)."""

    def all_reduce(self, t):
        return t


@pytest.mark.parametrize("world_size", [2, 3])
def test_vocab_parallel_embedding_parts_sum_to_the_full_lookup(world_size):
    c = tiny_config()
    table = torch.randn(c.vocab_size, c.hidden_size)
    ids = torch.tensor([0, 50, 51, 100, 7, 77])
    total = torch.zeros(len(ids), c.hidden_size)
    lm_parts = []
    h = torch.randn(3, c.hidden_size)
    for shard in plan_shards(c, world_size):
        local = rows(table, *shard.vocab)
        total += TensorParallelOps(_LocalSum(), shard).embed(ids, local)
        lm_parts.append(h @ local.T)
    assert torch.equal(total, table[ids])  # one rank adds the row, the others exact zeros
    torch.testing.assert_close(torch.cat(lm_parts, dim=1), h @ table.T)  # vocab columns in rank order


def _packed(qtype: Q, n: int, k: int, seed: int = 0) -> PackedBlocks:
    data = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    raw = gguf_quants.quantize(data, qtype)
    return PackedBlocks(qtype, torch.from_numpy(np.ascontiguousarray(raw)).view(n, -1), (n, k))


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0])
def test_packed_weights_slice_by_rows(qtype):
    p = _packed(qtype, 12, 128)
    dense = p.dequantize(torch.float32)
    r = rows(p, 3, 9)
    assert isinstance(r, PackedBlocks) and torch.equal(r.dequantize(torch.float32), dense[3:9])


def test_packed_model_weights_shard_to_the_dense_shards():
    c = tiny_config(qkv_bias=False, head_dim=32)
    w = random_weights(c)
    packed = dict(w)
    for i in range(c.num_layers):
        for n in ("self_attn.q_proj.weight", "self_attn.o_proj.weight", "mlp.down_proj.weight"):
            name = f"model.layers.{i}.{n}"
            packed[name] = _packed(Q.Q8_0, *w[name].shape, seed=i)
            w[name] = packed[name].dequantize(torch.float32)
    for shard in plan_shards(c, 2):
        sp, sd = shard_weights(packed, c, shard), shard_weights(w, c, shard)
        for name, t in sp.items():
            got = t.dequantize(torch.float32) if isinstance(t, PackedBlocks) else t
            assert torch.equal(got, sd[name]), name
        for n in ("mlp.down_proj.weight", "self_attn.o_proj.weight"):  # row slices stay packed
            assert isinstance(sp["model.layers.0." + n], PackedBlocks)


def test_plan_rejects_bad_sizes():
    with pytest.raises(ValueError, match="tensor_parallel_size: expected a positive integer"):
        plan_shards(tiny_config(), 0)
    with pytest.raises(ValueError, match="at most 3 ranks for an intermediate size of 96"):
        plan_shards(dataclasses.replace(tiny_config(), num_heads=8, num_kv_heads=8, intermediate_size=96), 4)


# -- CPU placement of ranks (platforms/cpu.py plan_binding under -tp) ---------------

def _topology(node_cpus: dict[int, list[int]]):
    from paged.backends.cpu.host.topology import NumaNode, Topology

    nodes = tuple(NumaNode(i, tuple(cpus), tuple((c,) for c in cpus), None, None) for i, cpus in node_cpus.items())
    every = tuple(c for cpus in node_cpus.values() for c in cpus)
    return Topology(nodes, every, every, True, {c: i for i, cpus in node_cpus.items() for c in cpus})


def test_auto_binding_gives_each_rank_its_numa_node_or_a_share_of_one():
    from paged.backends.cpu.host.binding import plan_binding

    two_sockets = _topology({0: [0, 1, 2, 3], 1: [4, 5, 6, 7]})
    plans = [plan_binding("auto", two_sockets, r, 2) for r in range(2)]
    assert [(p.cpus, p.node) for p in plans] == [([0, 1, 2, 3], 0), ([4, 5, 6, 7], 1)]
    one_node = _topology({0: [0, 1, 2, 3]})
    assert [plan_binding("auto", one_node, r, 2).cpus for r in range(2)] == [[0, 1], [2, 3]]
    assert plan_binding("0-1|2-3", one_node, 1, 2).cpus == [2, 3]
    with pytest.raises(ValueError, match="expected at most the 4 physical core"):
        plan_binding("auto", one_node, 0, 5)


def test_paged_env_reports_the_parallel_layout():
    from paged.core.entrypoints.cli import format_env, parallel_layout
    from paged.platforms.cpu import CpuPlatform

    platform = CpuPlatform(allowed=[0, 1])
    layout = parallel_layout(platform, "0|1", "2")
    assert layout["tensor_parallel_size"] == 2 and layout["collective_backend"] == "gloo"
    assert [(r["rank"], r["cpus"], r["threads"]) for r in layout["ranks"]] == [(0, "0", 1), (1, "1", 1)]
    text = format_env({"platform": "cpu", "paged": "x", "torch": "x", "python": "x", "compiled_modules": {},
                       "parallel": layout})
    assert "parallel        -tp 2 (spawn), collectives gloo" in text and "rank 1        device cpu, cpus 1" in text
