"""NpuBackend's own code on the SIMULATED NPU (tests/npu_sim: a plain-torch
stand-in for torch_npu on CPU tensors, installed only in this process).

What this covers: the layouts, per-step metadata, masks, slot mapping, the
Q_S = 1 route and the capability declaration, against the operators'
documented rules and the pure-torch reference. What it does not: device
placement, the real CANN kernels, their numerics or speed. None of this is
an NPU run (docs/ascend.md).
"""

from __future__ import annotations

import os
import re
import sys
import zipfile
from pathlib import Path

import entry_point_site
import pytest
import torch

from paged.backends.base import AttentionMetadata
from paged.backends.npu.attention import NpuBackend, layout
from paged.backends.reference.attention import ReferenceBackend
from paged.core.conformance import kernel_checks as kc

SIM_DIR = Path(__file__).parent / "npu_sim"
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Paged attention stores the KV cache in"]
#: greedy bf16 on the simulated NPU may leave the float32 CPU engine's tokens
#: only where the CPU's top-2 logit margin there is below this (nats). bf16
#: keeps 8 mantissa bits; the one divergence measured on these prompts was at
#: a margin of 0.010 (docs/ascend.md); 0.5 leaves room for rounding without
#: admitting a clear decision
MARGIN = 0.5


@pytest.fixture(scope="module")
def sim(tmp_path_factory):
    """The npu-sim platform reachable by name, the simulator installed."""
    site = tmp_path_factory.mktemp("npu_sim_site")
    entry_point_site.write_dist_info(SIM_DIR, site)
    sys.path[:0] = [str(site), str(SIM_DIR)]
    try:
        import paged_npu_sim
        from paged_npu_sim import torch_npu_sim

        available = paged_npu_sim.NpuSimPlatform().is_available()
        if not available.ok:
            pytest.skip(available.reason)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # as the platform runs (paged_npu_sim.NpuSimPlatform.bind_thread)
        yield torch_npu_sim
        torch.set_num_threads(threads)
        paged_npu_sim.uninstall()
    finally:
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
    prompt_call = call | dict(block_size=16, sparse_mode=3, atten_mask=layout.causal_mask("cpu"),
                              actual_seq_lengths=[3, 3], actual_seq_lengths_kv=[5, 20])
    with pytest.raises(sim.SimulatedNpuError, match="multiple of 128"):  # Q_S > 1 on 16-token blocks
        sim.npu_fused_infer_attention_score(q2, small, small, **prompt_call)
    with pytest.raises(sim.SimulatedNpuError, match="no padding slots"):
        sim.npu_scatter_pa_kv_cache(torch.zeros(1, 2, 64).bfloat16(), torch.zeros(1, 2, 64).bfloat16(),
                                    kc_, vc_, torch.tensor([-1]), cache_mode="Norm")


def _common(batch, num_decodes: int) -> AttentionMetadata:
    """One new token per sequence (its last position), decodes first."""
    bs = 128
    last = [n - 1 for n in batch.seq_lens.tolist()]
    slots = [int(batch.block_tables[i, p // bs]) * bs + p % bs for i, p in enumerate(last)]
    return AttentionMetadata(slot_mapping=torch.tensor(slots), query_start_loc=batch.query_start_loc,
                             seq_lens=batch.seq_lens, block_tables=batch.block_tables, num_decodes=num_decodes,
                             max_query_len=1, max_seq_len=max(last) + 1)


def test_detection_names_a_missing_operator(sim, monkeypatch):
    from paged_npu_sim import NpuSimPlatform

    monkeypatch.delattr(sim, "npu_fused_infer_attention_score")
    a = NpuSimPlatform().is_available()
    assert not a.ok and a.reason == ("torch_npu 2.13.0+simulator lacks npu_fused_infer_attention_score: "
                                     "pip install torch-npu==2.13.0")


# ---- the engine on the simulated NPU ---------------------------------------------------

@pytest.fixture(scope="module")
def suite(sim):
    """`paged conformance --quick` on npu-sim, in this process: (report, the
    engine it loaded: the default model in bfloat16 on NpuBackend)."""
    from paged_npu_sim import NpuSimPlatform

    from paged.core.conformance.runner import run_suite

    shared: dict = {}
    report = run_suite(NpuSimPlatform(), quick=True, cache=shared)
    if ("llm", False) not in shared:
        pytest.skip(f"the e2e checks loaded no engine: {report.table()}")
    return report, shared[("llm", False)][0]


def test_conformance_passes_on_the_simulated_npu(suite, sim):
    report, _ = suite
    assert report.passed, report.table()
    status = {r.name: r.status for r in report.results}
    assert all(r.status == "PASS" for r in report.results if r.required), report.table()
    assert report.declaration["block_sizes"] == "a multiple of 128 in [128, 512]"
    assert report.declaration["batch_invariant"] == {"bfloat16": [], "float16": []}
    assert {"kernels.edge_cases[bfloat16]", "kernels.edge_cases[float16]", "e2e.greedy_vs_reference"} <= set(status)
    assert sim.calls["npu_fused_infer_attention_score"] > 0 and sim.calls["npu_scatter_pa_kv_cache"] > 0


def test_no_host_sync_in_the_per_layer_path(suite, sim):
    """Real engine steps on NpuBackend: prefill, decode, a full prefix-cache
    hit leaving one token (Q_S = 1) alone and beside decodes; every layer's
    forward runs under a guard that fails on a device->host copy."""
    from conftest import step_until_idle

    from paged import SamplingParams

    _, llm = suite
    eng = llm.engine
    be = eng.attn_backend
    steps, forward, build = [], be.forward, be.build_metadata

    def guarded_forward(*args, **kw):
        with sim.HostSyncGuard(forbid=True):
            return forward(*args, **kw)

    def recorded_build(common):
        meta = build(common)
        steps.append((common.num_decodes, meta.num_decodes, meta.num_seqs, meta.prefill_q_lens))
        return meta

    be.forward, be.build_metadata = guarded_forward, recorded_build
    try:
        prompt = list(range(1000, 1129))  # 129 tokens: one full 128-token block cached, one token after it
        greedy = SamplingParams(max_tokens=3, temperature=0.0)
        eng.add_request("first", prompt, greedy)
        step_until_idle(eng)
        eng.add_request("alone", prompt, greedy)  # prefix hit: a 1-token prefill on its own
        step_until_idle(eng)
        eng.add_request("decoding", [7, 8, 9, 10], SamplingParams(max_tokens=6, temperature=0.0))
        eng.step()
        eng.add_request("beside", prompt, greedy)  # the 1-token prefill beside a decode
        done, failed = step_until_idle(eng)
    finally:
        del be.forward, be.build_metadata
    assert not failed and set(done) == {"decoding", "beside"}, failed
    assert any(nd == 0 and q and max(q) > 1 for nd, _, _, q in steps)  # a real prefill ran
    assert (0, 1, 1, []) in steps  # the prefix hit alone: routed to the decode call
    assert any(nd_in == 1 and nd == ns == 2 for nd_in, nd, ns, _ in steps)  # beside a decode: routed too
    # the guard itself catches a sync: the contract op (not the per-layer path) reads lengths on the host
    guard = sim.HostSyncGuard()
    case = kc.AttnCase(8, 2, 64, 128, (5, 9), query_lens=(2, 3))
    nb = NpuBackend(8, 2, 64, 128, torch.bfloat16, "cpu")
    batch, kv = _filled(nb, case)
    with guard:
        kc.run_attention(nb, batch, case, kv)
    assert "tolist" in guard.syncs


def test_greedy_bf16_matches_the_cpu_float32_engine(suite):
    """Greedy tokens of the default model, bfloat16 on the simulated NPU vs
    float32 on the CPU engine: equal, or the first divergence falls where
    the CPU's top-2 logit margin is below MARGIN."""
    from paged import LLM, SamplingParams

    _, llm = suite
    n = 16
    got = llm.generate(PROMPTS, SamplingParams(max_tokens=n, temperature=0.0))
    cpu = LLM(model=None, device="cpu", dtype="float32", linear_activations="float32", seed=0,
              kv_cache_memory="256MiB", max_model_len=2048)  # float32 activations, as the docstring says
    want = cpu.generate(PROMPTS, SamplingParams(max_tokens=n, temperature=0.0, logprobs=2))
    compared = 0
    for prompt, g, w in zip(PROMPTS, got, want):
        g_ids, w_out = g.outputs[0].token_ids, w.outputs[0]
        for i, (a, b) in enumerate(zip(g_ids, w_out.token_ids)):
            if a != b:
                top = sorted(w_out.logprobs[i].values(), reverse=True)
                margin = top[0] - top[1]
                assert margin < MARGIN, (f"{prompt!r}: token {i} is {a} on npu-sim bf16, {b} on cpu float32, "
                                         f"where the float32 top-2 margin is {margin:.3f} >= {MARGIN}")
                break
            compared += 1
    assert compared >= n, f"only {compared} tokens agreed before the divergences"


# ---- each release's operator signatures ---------------------------------------------

@pytest.fixture
def release(sim):
    """Switch the simulator to a release's signatures for one test (back to 2.13.0 after)."""
    yield sim.use_release
    sim.use_release("2.13.0")


@pytest.mark.parametrize("version, scatter_kwargs, scale", [
    ("2.13.0", {"cache_mode": "Norm"}, "scale"), ("2.10.0", {"cache_mode": "Norm"}, "scale"),
    ("2.7.1", {}, "scale"), ("2.1.0.post17", {}, "scale"), ("2.5.1", None, "scale"),
    ("2.13.0-scale_value", {"cache_mode": "Norm"}, "scale_value")])
def test_every_release_signature_is_called_right(sim, release, version, scatter_kwargs, scale):
    """The keywords are read from the installed release's operators: 2.7.1
    and 2.1.0.post17 have no cache_mode (passing it was a TypeError at the
    first cache write), 2.10+ default to 'PA_NZ' (an ND cache needs
    'Norm'), 2.5.1 has no scatter operator at all (an index copy writes the
    cache), and a scale_value spelling would be followed. Each signature
    runs a decode and a prefill step against the reference."""
    from paged.backends.npu import operators

    release(version)
    be = NpuBackend(8, 2, 64, 128, torch.bfloat16, "cpu")
    plan = be.operators
    assert plan.scale_keyword == scale and plan.scatter == (scatter_kwargs is not None)
    assert plan.scatter_kwargs == (scatter_kwargs or {}) and plan.read_from == "signature"
    assert version.split("-")[0] in plan.describe()
    for case in (kc.AttnCase(8, 2, 64, 128, (300, 1, 129)), kc.AttnCase(8, 2, 64, 128, (300, 40), query_lens=(30, 40))):
        batch, kv = _filled(be, case)
        got = kc.run_attention(be, batch, case, kv)
        ref = kc.run_attention(ReferenceBackend(8, 2, 64, 128, torch.bfloat16, "cpu"), batch, case)
        assert kc._rel_error(got, ref) < kc.TOLERANCE[torch.bfloat16]
    assert operators.plan(sim) == plan


def test_a_keyword_the_release_lacks_is_a_type_error(sim, release):
    release("2.8.0" if "2.8.0" in sim.RELEASES else "2.7.1")
    k = torch.zeros(1, 2, 64).bfloat16()
    cache = torch.zeros(2, 128, 2, 64).bfloat16()
    with pytest.raises(TypeError, match="cache_mode"):
        sim.npu_scatter_pa_kv_cache(k, k, cache, cache, torch.tensor([3]), cache_mode="Norm")
    release("2.13.0")
    with pytest.raises(sim.SimulatedNpuError, match="'PA_NZ'"):  # the 2.10+ default wants an NZ cache
        sim.npu_scatter_pa_kv_cache(k, k, cache, cache, torch.tensor([3]))


#: unpacked by csrc_ascend/fetch_torch_npu_headers.sh; more releases: PAGED_TORCH_NPU_WHEELS, folders of
#: wheels fetched with `pip download --no-deps torch-npu==<version>`
UNPACKED_2_13 = Path.home() / ".cache/paged/torch-npu-2.13.0"
_PROTOTYPES = "torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml"


def _wheel_sources() -> dict[str, Path]:
    found = {"2.13.0": UNPACKED_2_13} if (UNPACKED_2_13 / _PROTOTYPES).exists() else {}
    for folder in filter(None, os.environ.get("PAGED_TORCH_NPU_WHEELS", "").split(os.pathsep)):
        found.update({w.name.split("-")[1]: w for w in sorted(Path(folder).glob("torch_npu-*.whl"))})
    return found


def _wheel_keywords(source: Path, op: str) -> list[tuple[str, str]] | None:
    """The keyword-only (name, default) pairs of ``op``'s prototype in a
    torch-npu wheel (or its unpacked folder); None when it has no such op."""
    if source.suffix == ".whl":
        with zipfile.ZipFile(source) as z:
            text = z.read(_PROTOTYPES).decode()
    else:
        text = (source / _PROTOTYPES).read_text()
    m = re.search(rf"func: {op}\((.*?)\) ->", text)
    if m is None:
        return None
    keyword_only = m.group(1).split(", *, ", 1)[1].split(", ")
    return [(a.split("=")[0].split()[-1], a.split("=")[1].strip("'\"")) for a in keyword_only]


@pytest.mark.parametrize("version, source", sorted(_wheel_sources().items()) or [
    pytest.param(None, None, marks=pytest.mark.skip(reason="no torch-npu wheel here "
                 "(csrc_ascend/fetch_torch_npu_headers.sh, or PAGED_TORCH_NPU_WHEELS)"))])
def test_simulated_signatures_are_the_wheels_prototypes(sim, version, source):
    """Each simulated release's operator keywords (names, order, cache_mode's
    default) are those of the release's PyPI wheel prototypes, so the
    keyword choice tested above is the one each release needs (the
    simulator once took cache_mode everywhere and misspelled
    compress_seq_offsets). Grounding, not a device run."""
    release = sim.SAME_AS.get(version, version)
    assert release in sim.RELEASES, f"torch-npu {version}: the simulator has no signature for it"
    scatter, attention = sim.RELEASES[release]
    wheel_scatter = _wheel_keywords(source, "npu_scatter_pa_kv_cache")
    assert (None if scatter is None else [k for k, _ in scatter]) == (
        None if wheel_scatter is None else [k for k, _ in wheel_scatter])
    if scatter and dict(scatter).get("cache_mode"):
        assert dict(wheel_scatter)["cache_mode"] == dict(scatter)["cache_mode"] == "PA_NZ"
    assert [k for k, _ in attention] == [k for k, _ in _wheel_keywords(source, "npu_fused_infer_attention_score")]


# ---- documented limits: in the simulator, and checked at metadata build ----------------

def _decode_step(tables, lens, bs=128):
    """Decode metadata for sequences with these block tables and lengths."""
    slots = [t[(n - 1) // bs] * bs + (n - 1) % bs for t, n in zip(tables, lens)]
    return AttentionMetadata(slot_mapping=torch.tensor(slots), query_start_loc=torch.arange(len(lens) + 1,
                             dtype=torch.int32), seq_lens=torch.tensor(lens, dtype=torch.int32),
                             block_tables=torch.tensor(tables, dtype=torch.int32), num_decodes=len(lens),
                             max_query_len=1, max_seq_len=max(lens))


def test_block_sum_rule_is_checked_at_metadata_build(sim):
    """Prefix caching shares blocks in the pool, but the operator wants the
    pool to hold the SUM of every sequence's blocks in the call: two
    300-token sequences sharing their first two blocks use 4 blocks of the
    pool and span 6. One line, before any layer runs; the simulator refuses
    the call too."""
    be = NpuBackend(8, 2, 64, 128, torch.bfloat16, "cpu")
    step = _decode_step([[0, 1, 2], [0, 1, 3]], [300, 300])
    be.allocate_kv_cache(1, 6)
    be.build_metadata(step)  # a pool of 6 covers the call
    ((kc_, vc_),) = be.allocate_kv_cache(1, 4)
    with pytest.raises(ValueError) as e:
        be.build_metadata(step)
    msg = str(e.value)
    assert msg.startswith("num_blocks (npu paged attention: the pool must cover the sum of the call's "
                          "per-sequence blocks): expected at least the 6 blocks the call's 2 sequences span")
    assert msg.endswith(", got 4") and "\n" not in msg
    q = torch.randn(2, 1, 8 * 64).bfloat16()
    with pytest.raises(sim.SimulatedNpuError, match="at least the 6 blocks"):
        sim.npu_fused_infer_attention_score(q, be._flat_cache(kc_), be._flat_cache(vc_), block_table=step.block_tables,
                                            actual_seq_lengths_kv=[300, 300], num_heads=8, num_key_value_heads=2,
                                            scale=0.125, input_layout="BSH", block_size=128)


def test_one_token_int32_limit_is_checked_at_metadata_build_and_sizing(sim):
    """The one-token branch takes at most 2**31 - 1 elements per key (and
    value) tensor: a large --kv-cache-memory with few layers used to fail at
    the first decode. Checked at metadata build (one line), capped at sizing."""
    from paged.backends.npu.worker import NpuWorker
    from paged.core.engine.worker import Worker

    be = NpuBackend(8, 2, 64, 128, torch.bfloat16, "cpu")
    limit = layout.max_decode_blocks(128, 2, 64)
    assert limit == (2**31 - 1) // (128 * 2 * 64) == 131071
    be.num_blocks = limit + 1  # (not allocated: 4 GiB)
    with pytest.raises(ValueError) as e:
        be.build_metadata(_decode_step([[0, 1, 2]], [300]))
    msg = str(e.value)
    assert msg.startswith("key/value cache elements per layer (npu one-token branch): expected <= 2147483647") \
        and msg.endswith(f"got {(limit + 1) * 128 * 2 * 64}") and "\n" not in msg
    be.num_blocks = limit
    be.build_metadata(_decode_step([[0, 1, 2]], [300]))
    # sizing caps the pool there instead (the worker's part)
    w = NpuWorker.__new__(NpuWorker)
    w.backend = be
    original = Worker.determine_num_blocks
    try:
        Worker.determine_num_blocks = lambda self, *a: 10 * limit
        assert w.determine_num_blocks(None, 2048, 64, 512) == limit
    finally:
        Worker.determine_num_blocks = original
    # and the simulator refuses such a call (a 0-stride view: the shape counts, nothing is allocated)
    big = torch.zeros(1, 128, 2 * 64).bfloat16().expand(limit + 1, 128, 2 * 64)
    with pytest.raises(sim.SimulatedNpuError, match="at most 2147483647 elements"):
        sim.npu_fused_infer_attention_score(torch.zeros(1, 1, 8 * 64).bfloat16(), big, big,
                                            block_table=torch.zeros(1, 1, dtype=torch.int32),
                                            actual_seq_lengths_kv=[5], num_heads=8, num_key_value_heads=2,
                                            scale=0.125, input_layout="BSH", block_size=128)


def test_stray_block_ids_read_silently_in_the_operator_and_are_refused_before(sim):
    """The operator does not validate block ids (documented): the simulator
    reads NaN for a stray one instead of refusing, and NpuBackend's step
    check stops it before any layer."""
    be = NpuBackend(8, 2, 64, 128, torch.bfloat16, "cpu")
    ((kc_, vc_),) = be.allocate_kv_cache(1, 4)
    before = sim.calls["stray_block_reads"]
    out, _ = sim.npu_fused_infer_attention_score(
        torch.randn(1, 1, 8 * 64).bfloat16(), be._flat_cache(kc_), be._flat_cache(vc_),
        block_table=torch.tensor([[2, 9]], dtype=torch.int32), actual_seq_lengths_kv=[200], num_heads=8,
        num_key_value_heads=2, scale=0.125, input_layout="BSH", block_size=128)
    assert torch.isnan(out).all() and sim.calls["stray_block_reads"] == before + 1
    with pytest.raises(IndexError, match=r"block_tables\[0, 0\]: expected a block id in \[0, 4\), got 9"):
        be.build_metadata(_decode_step([[9, 2]], [200]))


def test_simulator_refuses_the_documented_shape_limits(sim):
    call = dict(num_heads=8, num_key_value_heads=1, scale=0.125, input_layout="BSH", block_size=128)
    cache = torch.zeros(2050, 128, 16).bfloat16()  # 1 kv head of 16
    q = torch.zeros(1, 1, 8 * 16).bfloat16()
    table = torch.arange(2050, dtype=torch.int32)[None]
    with pytest.raises(sim.SimulatedNpuError, match="keys per sequence <= 262144"):
        sim.npu_fused_infer_attention_score(q, cache, cache, block_table=table, actual_seq_lengths_kv=[262145],
                                            **call)
    sim.npu_fused_infer_attention_score(q, cache, cache, block_table=table, actual_seq_lengths_kv=[262144], **call)
    with pytest.raises(sim.SimulatedNpuError, match="N <= 256"):
        sim.npu_fused_infer_attention_score(torch.zeros(1, 1, 272 * 16).bfloat16(), cache, cache, block_table=table,
                                            actual_seq_lengths_kv=[5], **(call | dict(num_heads=272)))
    big = torch.zeros(1, 2, 256 * 256).bfloat16()  # N * D = 65536 with Q_S > 1
    kvc = torch.zeros(2, 128, 256).bfloat16()
    with pytest.raises(sim.SimulatedNpuError, match="N \\* D < 65535"):
        sim.npu_fused_infer_attention_score(big, kvc, kvc, block_table=table[:, :2], actual_seq_lengths_kv=[5],
                                            **(call | dict(num_heads=256)))
    prompt = call | dict(sparse_mode=4, pre_tokens=4, next_tokens=0, actual_seq_lengths=[2])
    with pytest.raises(sim.SimulatedNpuError, match="with sparse_mode 4 a 2048 x 2048"):
        sim.npu_fused_infer_attention_score(torch.zeros(1, 2, 8 * 16).bfloat16(), cache, cache, block_table=table,
                                            actual_seq_lengths_kv=[5], **prompt)


def test_sliding_window_prefill_is_a_band_on_the_compressed_mask(sim, monkeypatch):
    """Sliding-window prefill goes through sparse_mode 4 (band, pre_tokens =
    window - 1) with the cached 2048 x 2048 mask, not a dense [B, 1, max_q,
    KV_S] mask (512 MiB a step at 8 x 512 x 131072); equal to the reference."""
    seen = []
    real = sim.npu_fused_infer_attention_score

    def recording(*args, **kw):
        seen.append({k: kw.get(k) for k in ("sparse_mode", "pre_tokens", "next_tokens")}
                    | {"mask": None if kw.get("atten_mask") is None else tuple(kw["atten_mask"].shape)})
        return real(*args, **kw)

    monkeypatch.setattr(sim, "npu_fused_infer_attention_score", recording)
    case = kc.AttnCase(8, 2, 64, 128, (700, 300, 50), query_lens=(200, 300, 50), sliding_window=100)
    be = NpuBackend(8, 2, 64, 128, torch.bfloat16, "cpu", sliding_window=100)
    batch, kv = _filled(be, case)
    got = kc.run_attention(be, batch, case, kv)
    ref = kc.run_attention(ReferenceBackend(8, 2, 64, 128, torch.bfloat16, "cpu", sliding_window=100), batch, case)
    assert kc._rel_error(got, ref) < kc.TOLERANCE[torch.bfloat16]
    assert seen == [{"sparse_mode": 4, "pre_tokens": 99, "next_tokens": 0, "mask": (2048, 2048)}]


def test_per_layer_windows_reach_each_layers_operator_call(sim, monkeypatch):
    """Layers with their own sliding window (Gemma 3: local layers beside
    global ones, core/models/layer_attention.py) on one NpuBackend sized for
    the widest (none): one step's metadata, and each layer's two calls get
    its own window's arguments (the decode call's [B, KV_S] mask, the
    prefill call's band), derived on the device without a host read; every
    layer equal to the reference backend made for its window. Before, the
    step's masks were the backend's one window, so such a model was refused
    at build."""
    from paged.core.models.layer_attention import layer_attention

    seen = []
    real = sim.npu_fused_infer_attention_score

    def recording(query, *args, **kw):
        mask = kw.get("atten_mask")
        seen.append((query.shape[1], kw.get("sparse_mode"), kw.get("pre_tokens"),
                     None if mask is None else tuple(mask.shape)))
        return real(query, *args, **kw)

    monkeypatch.setattr(sim, "npu_fused_infer_attention_score", recording)
    # two decodes (700, 130 tokens), a 200-token chunk over a 300-token prefix, a 50-token prompt
    case = kc.AttnCase(8, 2, 64, 128, (700, 130, 500, 50), query_lens=(1, 1, 200, 50), pad_slots=0)
    be = NpuBackend(8, 2, 64, 128, torch.bfloat16, "cpu")
    batch = kc.make_batch(case, torch.bfloat16)
    lens = case.seq_lens
    new_rows = torch.cat([torch.arange(sum(lens[:i]) + n - q, sum(lens[:i]) + n)  # each sequence's last q rows
                          for i, (n, q) in enumerate(zip(lens, case.query_lens))])
    common = AttentionMetadata(batch.slot_mapping[new_rows], batch.query_start_loc, batch.seq_lens,
                               batch.block_tables, num_decodes=2, max_query_len=200, max_seq_len=700)
    key, value = batch.key[new_rows], batch.value[new_rows]
    windows = (0, 100, 1, 300, 100)
    caches = be.allocate_kv_cache(len(windows), batch.num_blocks)
    for kv in caches:
        be.reshape_and_cache(batch.key, batch.value, *kv, batch.slot_mapping)
    meta = be.build_metadata(common)
    outs = []
    with sim.HostSyncGuard(forbid=True):
        for window, kv in zip(windows, caches):
            outs.append(layer_attention(be, window, be.scale).forward(batch.query, key, value, kv, meta))
    refs = {}
    for window, out in zip(windows, outs):
        ref = ReferenceBackend(8, 2, 64, 128, torch.bfloat16, "cpu", sliding_window=window)
        refs[window] = ref.forward(batch.query, key, value, kc.filled_cache(ref, batch), common)
        assert kc._rel_error(out, refs[window]) < kc.TOLERANCE[torch.bfloat16], window
    assert kc._rel_error(refs[100], refs[0]) > 10 * kc.TOLERANCE[torch.bfloat16]  # the windows matter here
    masks = {(q, mode, pre, shape) for q, mode, pre, shape in seen}
    assert masks == {(1, None, None, None), (200, 3, None, (2048, 2048)),  # window 0
                     (1, None, None, (2, 896)), (200, 4, 99, (2048, 2048)),  # 100
                     (200, 4, 0, (2048, 2048)), (200, 4, 299, (2048, 2048))}  # 1, 300 (decode masks: [2, 7 x 128])
    assert len(seen) == 2 * len(windows) and sorted(meta.other_windows) == [1, 100, 300]


def test_gemma3_local_and_global_layers_on_the_simulated_npu(sim, tmp_path, monkeypatch):
    """A tiny Gemma 3 (tests/family_models.py: six layers with an 8-token
    window, one global) in bfloat16 on NpuBackend over the simulator: a
    batched prefill of prompts longer than the window, then greedy decode
    steps, equal to the reference backend on the same weights; and not equal
    to the same model with its windows removed (the windows matter here).
    Before, the model was refused at build (one window per NpuBackend)."""
    import dataclasses

    import paged_npu_sim

    paged_npu_sim.uninstall()  # transformers probes torch_npu at import: make the HF model first
    try:
        import family_models as fm

        fm.make_hf(fm.FAMILIES["gemma3"], tmp_path / "hf")
    finally:
        assert paged_npu_sim.NpuSimPlatform().is_available().ok
    from paged.core.models import build_model
    from paged.core.models.loaders import load_model_files

    monkeypatch.setattr(fm, "BLOCK", 128)  # the NPU's block size
    loaded = load_model_files(tmp_path / "hf", torch.bfloat16, quiet=True)
    c, weights = loaded.config, loaded.weights
    assert c.spec.windows() == [8, 8, 8, 8, 8, 0, 8] and not c.sliding_window
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(10, c.vocab_size, (n,), generator=g).tolist() for n in (24, 13, 19)]
    unwindowed = dataclasses.replace(c, decoder=c.decoder.with_layers(
        dataclasses.replace(layer, attention=dataclasses.replace(layer.attention, sliding_window=0))
        for layer in c.decoder.layers))
    runs = {}
    for name, config, cls in (("npu", c, NpuBackend), ("reference", c, ReferenceBackend),
                              ("no windows", unwindowed, ReferenceBackend)):
        be = cls(c.num_heads, c.num_kv_heads, c.head_dim, 128, torch.bfloat16, "cpu")
        logits, tokens = fm.greedy_run(build_model(config, weights, torch.bfloat16, "cpu", be), be,
                                       c.num_layers, prompts, 4)
        runs[name] = torch.cat(logits).float(), tokens
    assert runs["npu"][1] == runs["reference"][1]
    assert (runs["npu"][0] - runs["reference"][0]).abs().max() < 0.02
    gap = (runs["no windows"][0] - runs["reference"][0]).abs().max()
    assert gap > 0.1, gap


def test_step_metadata_reads_no_device_data(sim, monkeypatch):
    """A runner step's NPU metadata (block-id checks, the operators' host
    lists, write rows, padding gathers) comes from the runner's host arrays:
    with the index tensors on an EMULATED device ("meta": its data cannot be
    read) it still builds, with ONE host->device copy for its index arrays.
    Before, check_slots / check_block_tables / check_query_start_loc and the
    length lists each copied back from the device."""
    import numpy as np

    from paged.backends.npu import metadata as step
    from paged.core.engine.model_runner import HostBatch, StepMetadata, to_device

    copies = []
    monkeypatch.setattr(step, "to_device", lambda arrays, dev: copies.append(sorted(arrays)) or to_device(arrays, dev))
    be = NpuBackend(8, 2, 64, 128, torch.bfloat16, "meta", sliding_window=64)
    be.num_blocks = 8
    # a decode (300 tokens), a 40-token prefill over a 60-token prefix; one padding slot
    tables = np.array([[0, 1, 2], [3, 0, 0]], dtype=np.int32)
    slots = np.array([2 * 128 + 43] + [3 * 128 + p for p in range(60, 100)] + [-1], dtype=np.int64)
    b = HostBatch(np.zeros(42, dtype=np.int64), np.zeros(42, dtype=np.int64), slots,
                  np.array([0, 1, 42], dtype=np.int32), np.array([300, 101], dtype=np.int32), tables, 1,
                  np.array([0, 41]), 1)
    t = to_device({"slot_mapping": slots, "query_start_loc": b.query_start_loc, "seq_lens": b.seq_lens,
                   "block_tables": tables}, torch.device("meta"))
    copies.clear()
    meta = be.build_metadata(StepMetadata(**t, num_decodes=1, max_query_len=41, max_seq_len=300, host=b))
    assert copies == [["pad_index", "unpad_index", "write_rows"]]
    assert meta.decode_kv_lens == [300] and meta.prefill_q_lens == [41] and meta.prefill_kv_lens == [101]
    assert meta.decode_mask.shape == (1, 384) and meta.prefill_extra["sparse_mode"] == 4


# ---- the precision model ----------------------------------------------------------------

def test_split_precision_makes_batch_invariance_measurable(sim):
    """With exact float32 softmax per sequence, a sequence alone and in a
    batch are bitwise equal on the simulator whatever the NPU does; the
    "split" model (chunks cut by the batch, P rounded to bf16) differs, as a
    split-K kernel does. Invariance figures of the simulator mean nothing in
    exact mode."""
    case = kc.AttnCase(8, 2, 64, 128, (1500, 700, 300, 900))
    be = NpuBackend(8, 2, 64, 128, torch.bfloat16, "cpu")
    batch, kv = _filled(be, case)
    diffs = {}
    try:
        for mode in ("exact", "split"):
            sim.set_precision(mode)
            full = kc.run_attention(be, batch, case, kv)
            alone = kc.run_attention(be, batch, case, kv, rows=[0])
            diffs[mode] = (alone[0] - full[0]).abs().max().item()
    finally:
        sim.set_precision("exact")
    assert diffs["exact"] == 0 and diffs["split"] > 0, diffs
    ref = kc.run_attention(ReferenceBackend(8, 2, 64, 128, torch.bfloat16, "cpu"), batch, case)
    sim.set_precision("split")
    try:
        assert kc._rel_error(kc.run_attention(be, batch, case, kv), ref) < kc.TOLERANCE[torch.bfloat16]
    finally:
        sim.set_precision("exact")


# ---- the profiled NPU budget ------------------------------------------------------------

def test_npu_budget_is_this_instances_share_after_a_profiled_step(suite, sim):
    """No more "a flat 25% of free memory": the worker runs the worst-case
    step (here once, by hand: the simulator's statistics read 0, so engines
    on it skip it) and the budget is --gpu-memory-utilization x total minus
    what this instance uses, as on CUDA."""
    from paged_npu_sim import NpuSimPlatform

    _, llm = suite
    worker = llm.engine.worker
    blocks = worker.backend.num_blocks
    try:
        lens = worker.profile_step(24)
    finally:
        worker.backend.num_blocks = blocks
    assert sum(lens) == 24
    p = NpuSimPlatform()
    assert p.kv_cache_budget_bytes(profiled_peak_bytes=2**30) == int(0.9 * sim.SIM_TOTAL) - 2**30
    with pytest.raises(ValueError, match="--gpu-memory-utilization 0.95: expected the 60.80 GiB share"):
        p.start_accounting(0.95)  # 60 GiB free of 64
