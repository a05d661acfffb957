"""A tensor-parallel model computes the single process's bits.

The real sharding (core/engine/distributed/sharding.py) and TensorParallelOps run
with the ranks as threads taking turns (core/engine/distributed/local_group.py), on
the default model, through a scenario of chunked prefill on a cached prefix,
decodes beside prompt rows and decode batches (tests/step_inputs.py, prompt
rows marked as the runner marks them). Oracle: the unsharded model on the
Python layer path. Every rank's final hidden states and logits, and its
heads of every layer's KV cache, must equal the single process's bit for
bit on the default path (quantized activations, whose int8 codes turn any
ulp of difference into another code) and on the float32 and int8x2 paths.
The process-level test is tests/test_tensor_parallel.py.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from paged.core.engine.distributed.local_group import ThreadRanks
from paged.core.engine.distributed.parallel_ops import TensorParallelOps
from paged.core.engine.distributed.sharding import local_config, plan_shards, shard_weights
from paged.core.models import build_model

pytest.importorskip("paged._C_cpu")
from paged.backends.cpu.attention import CpuBackend  # noqa: E402
from paged.backends.cpu.quant_linear import CpuPackedLinear, resolve_activations  # noqa: E402
from paged.backends.cpu.worker import prepare_model  # noqa: E402
from step_inputs import BLOCK, LENGTHS, MAX_BLOCKS, SCENARIO, step  # noqa: E402


@pytest.fixture(scope="module")
def default_packed(default_model_path):
    from paged.core.models.loaders import load_model_files

    loaded = load_model_files(default_model_path, torch.float32, quiet=True, keep_packed=True)
    return loaded.config, loaded.weights


def make(config, weights, activations: str, kv_dtype: torch.dtype, parallel=None):
    backend = CpuBackend(config.num_heads, config.num_kv_heads, config.head_dim, BLOCK, torch.float32, "cpu",
                         kv_cache_dtype=kv_dtype)
    model = build_model(config, weights, torch.float32, "cpu", backend,
                        functools.partial(CpuPackedLinear, activations=activations), parallel)
    prepare_model(model)
    model.layer_stack = None  # a rank runs the Python layers; the stack's equality is test_layer_stack's
    return model, backend.allocate_kv_cache(config.num_layers, len(LENGTHS) * MAX_BLOCKS)


def run_scenario(model, caches, tokens) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    with torch.inference_mode():
        for _name, work, nd in SCENARIO:
            ids, pos, meta = step(tokens, work, nd, mark_prompt_rows=True)
            hidden = model(ids, pos, caches, meta)
            out.append((hidden, model.compute_logits(hidden)))
    return out


PATHS = {"default": None, "int8x2": "int8x2", "float32": "float32"}


@pytest.mark.parametrize("tp", [2, 3])
@pytest.mark.parametrize("path", list(PATHS))
def test_ranks_compute_the_single_process_bits(default_packed, path, tp):
    config, weights = default_packed
    activations = PATHS[path] or resolve_activations("auto")
    kv_dtype = torch.float16 if path == "default" else torch.float32  # what the engine picks for each
    tokens = [np.random.default_rng(7).integers(0, config.vocab_size, n + 12).tolist() for n in LENGTHS]
    single, single_caches = make(config, weights, activations, kv_dtype)
    want = run_scenario(single, single_caches, tokens)

    group = ThreadRanks(tp)
    shards = plan_shards(config, tp)
    ranks = [make(local_config(config, s), shard_weights(weights, config, s), activations, kv_dtype,
                  TensorParallelOps(group.comm(s.rank), s)) for s in shards]
    got = group.run([lambda _comm, m=m, c=c: run_scenario(m, c, tokens) for m, c in ranks])
    for rank, (shard, results, (_, caches)) in enumerate(zip(shards, got, ranks)):
        for (name, _, _), (h, logits), (h_want, logits_want) in zip(SCENARIO, results, want):
            assert torch.equal(h, h_want), f"-tp {tp} rank {rank}, {name}: hidden states differ"
            assert torch.equal(logits, logits_want), f"-tp {tp} rank {rank}, {name}: logits differ"
        k0, k1 = shard.kv_heads
        for layer, ((k, v), (k_want, v_want)) in enumerate(zip(caches, single_caches)):
            assert torch.equal(k, k_want[:, k0:k1]) and torch.equal(v, v_want[:, k0:k1]), \
                f"-tp {tp} rank {rank}: layer {layer}'s KV cache differs"


def test_thread_ranks_surface_a_rank_failure():
    group = ThreadRanks(2)

    def fails(comm):
        raise ValueError("rank 1 broke")

    with pytest.raises(ValueError, match="rank 1 broke"):
        group.run([lambda comm: comm.all_reduce(torch.ones(2)), fails])
