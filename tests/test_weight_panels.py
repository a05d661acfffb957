"""Persistent int8 weight panels (issue #15; csrc_cpu/linear/weight_panels.h).

The avx512 int8 kernel's per-call panel of widened codes and transposed
scales, built once per matrix: quant_linear with ``panels`` must return
bitwise what it returns without (the oracle is the uncached kernel, itself
tested against the scalar build and the dense reference in
test_quant_linear_int8.py), the tensor must be refused under another build,
shape or size, and the engine's greedy output must not change."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from test_layer_stack import BLOCK, LENGTHS, MAX_BLOCKS, step, tiny_config, tiny_weights
from test_quant_linear import QTYPES, random_weight

from paged import _C_cpu as C
from paged.backends.cpu.attention import CpuBackend
from paged.backends.cpu import quant_linear as ql
from paged.backends.cpu.worker import prepare_model
from paged.core.models import build_model

pytestmark = pytest.mark.skipif("avx512" not in C.supported_linear_isas(),
                                reason="this CPU lacks AVX-512 F/BW/VL/DQ + AVX512_VNNI: only the avx512 build "
                                       "has weight panels")


@pytest.fixture
def avx512():
    C.set_linear_isa("avx512")
    yield
    C.set_linear_isa("auto")


def build(qtype, qs, d, m) -> torch.Tensor:
    panels = torch.empty(C.weight_panel_bytes(qtype, qs, d, m), dtype=torch.uint8)
    C.build_weight_panels(qtype, qs, d, m, panels)
    return panels


def call(x, qtype, qs, d, m, activations, two_term_rows=-1, panels=None) -> torch.Tensor:
    out = torch.full((x.shape[0], qs.shape[0]), float("nan"))
    C.quant_linear(x, qtype, qs, d, m, out, activations, two_term_rows, panels)
    return out


@pytest.fixture(params=[1, 8], ids=["nibbles-tiles-above-1-row", "nibbles-in-place-to-8-rows"])
def nibble_rows(request):
    """Where 4-bit panels stop being read in place (nibble_panel_rows: the
    CPU's default lies between): both kernels at every row count, on any CPU."""
    C.set_nibble_panel_rows(request.param)
    yield request.param
    C.set_nibble_panel_rows(0)


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("n", [96, 72])  # whole chunks of 32 rows, and a partial last chunk
@pytest.mark.parametrize("fp16_scales", [True, False], ids=["fp16-scales", "float32-scales"])
def test_cached_panels_are_bitwise_the_per_call_panels(avx512, nibble_rows, qtype, n, fp16_scales):
    gen = torch.Generator().manual_seed(3)
    qs, d, m = random_weight(qtype, n, 8 * 32 + 64, gen)  # 10 blocks: transposes of 16 and the scalar rest
    fp16_bytes = C.weight_panel_bytes(qtype, qs, d, m)
    if not fp16_scales:  # GGUF's scales are fp16 values, which panels keep in 2 bytes; others need 4
        d = d * (1 + 2**-20)
        arrays = 2 if qtype == "q4_1" else 1  # d, and q4_1's m (float32 too: one form per panel)
        assert C.weight_panel_bytes(qtype, qs, d, m) == fp16_bytes + arrays * ((n + 31) // 32) * 32 * 10 * 2
    panels = build(qtype, qs, d, m)
    assert C.weight_panel_layout() == "avx512/5"
    for rows in (1, 2, 3, 4, 8, 9, 16, 33, 100):  # q4: nibbles in place up to nibble_rows, tiles above; q8_0: bytes
        x = torch.randn(rows, d.shape[1] * 32, generator=gen) * 2
        for act, split in (("int8", -1), ("int8x2", -1), ("int8x2", rows // 3)):
            want = call(x, qtype, qs, d, m, act, split)
            got = call(x, qtype, qs, d, m, act, split, panels)
            assert torch.equal(got, want), (rows, act, split)


def s16_weights():
    """Packed s16 matrices as the K-quants load (compact scales; Q6_K without
    offsets), the same with float32 scales and offsets, and with fp16 ones."""
    from gguf import GGMLQuantizationType as Q
    from test_quant_layouts import random_blocks

    from paged.core.models.loaders.quant_layouts import pack_s16_codes, unpack, widen_scales

    n, k = 72, 512  # a partial last chunk of 32 rows
    for seed, qtype in enumerate((Q.Q2_K, Q.Q3_K, Q.Q5_K, Q.Q6_K)):
        layout, codes, d, m = unpack(qtype, torch.from_numpy(random_blocks(qtype, n, k, seed)), (n, k))
        qs, form = pack_s16_codes(codes)
        yield f"{qtype.name}-compact", form, qs, d, m
        wd, wm = widen_scales(d, layout), widen_scales(m, layout)
        yield f"{qtype.name}-float32", form, qs, wd, wm
        half = wd.to(torch.float16).float()
        yield f"{qtype.name}-fp16", form, qs, half, (torch.randn_like(half) * 0.01).to(torch.float16).float()


@pytest.fixture(params=[8, 4096], ids=["tiles-above-8-rows", "in-place-always"])
def panel_rows(request):
    """Where s16 panels stop being read in place (s16_panel_rows: the CPU's
    default lies between): both kernels at every row count, on any CPU."""
    C.set_s16_panel_rows(request.param)
    yield request.param
    C.set_s16_panel_rows(0)


@pytest.mark.parametrize("case", list(s16_weights()), ids=lambda c: c[0])
def test_s16_panels_are_bitwise_the_packed_codes(avx512, panel_rows, case):
    """s16's packed codes in persistent panels (16 weight rows a vector, read in
    place up to panel_rows rows and turned into the tiles' panels above):
    bitwise the calls on the packed arrays, and unpack_weight_panels gives
    those arrays back byte for byte from a panel of their size."""
    name, qtype, qs, d, m = case
    panels = build(qtype, qs, d, m)
    # the header's scale form (PanelScales): compact with fp16 supers (GGUF's d and -dmin), in pairs for Q5_K
    # (its scales are per 32)
    form = {"compact": 5 if name.startswith("Q5_K") else 4, "fp16": 1, "float32": 0}[name.split("-")[1]]
    assert int(panels[56]) == form
    arrays = sum(t.numel() * t.element_size() for t in (qs, d, m) if t is not None)
    padded = arrays * 96 // 72  # 72 rows in 3 chunks of 32
    if form == 4:  # compact scales: the packed size less 2 bytes a super (K = 512: 2 per row and array)
        assert panels.numel() - 64 == padded - 96 * 2 * 2 * (1 if m is None else 2)
    elif form:  # compact pairs, fp16 values: less than the packed arrays (float32 scales)
        assert panels.numel() - 64 < padded
    gen = torch.Generator().manual_seed(6)
    # in place up to panel_rows rows, the tiles' panels above; the offsets take x rows 8 at a time, then 4 / 2 / 1
    for rows in (1, 2, 3, 4, 5, 7, 8, 9, 16, 33, 49, 63):
        x = torch.randn(rows, 512, generator=gen) * 2
        for act, split in (("int8", -1), ("int8x2", -1), ("int8x2", rows // 3)):
            want = call(x, qtype, qs, d, m, act, split)
            got = call(x, qtype, qs, d, m, act, split, panels)
            assert torch.equal(got, want), (rows, act, split)
    back = [torch.empty_like(t) if t is not None else None for t in (qs, d, m)]
    C.unpack_weight_panels(qtype, panels, *back)
    for t, u in zip((qs, d, m), back):
        assert (t is None and u is None) or torch.equal(t.view(torch.uint8), u.view(torch.uint8))


def proc_cpuinfo_vendor() -> str | None:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("vendor_id")), None)
    except OSError:
        return None


@pytest.mark.parametrize("knob,env,lo,hi,amd,other", [("s16_panel_rows", "PAGED_S16_PANEL_ROWS", 8, 4096, 48, 12),
                                                      ("nibble_panel_rows", "PAGED_NIBBLE_PANEL_ROWS", 1, 8, 8, 1)])
def test_panel_crossover_default_checks_and_override(knob, env, lo, hi, amd, other):
    """Where s16 / 4-bit panels stop being read in place: the core's
    crossover (csrc_cpu/linear/s16.h, int8.h), by the vendor as /proc/cpuinfo
    names it; the setter and the environment variable refuse what the
    kernels were not built for with the one ValueError shape."""
    get, put = getattr(C, knob), getattr(C, "set_" + knob)
    vendor = proc_cpuinfo_vendor()
    if vendor is not None:
        assert C.cpu_vendor() == vendor
    default = amd if C.cpu_vendor() == "AuthenticAMD" else other
    override = os.environ.get(env, "0")  # (a run under the variable gets its value)
    assert get() == (int(override) if override != "0" else default)
    try:
        put(hi)
        assert get() == hi
        for bad in [v for v in (lo - 1, -1, hi + 1) if v != 0]:  # (0 asks for the default)
            with pytest.raises(ValueError, match=rf"rows: expected an integer in \[{lo}, {hi}\].*got '{bad}'"):
                put(bad)
        assert get() == hi  # a refused value changes nothing
    finally:
        put(0)
    code = f"from paged import _C_cpu as C\ntry:\n print(C.{knob}())\nexcept ValueError as e:\n print(e)"
    for value, want in ((str(lo + 1), str(lo + 1)), ("0", str(default)),
                        ("lots", f"{env}: expected an integer in [{lo}, {hi}] (0: the CPU's default), got 'lots'")):
        env_vars = dict(os.environ, **{env: value})
        out = subprocess.run([sys.executable, "-c", code], env=env_vars, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0 and out.stdout.strip() == want, (value, out.stdout, out.stderr)


def test_bad_crossover_variable_is_a_value_error_not_a_crash():
    """A call on 4-bit panels chooses its crossover before its threads start:
    a bad PAGED_NIBBLE_PANEL_ROWS is the call's ValueError, every time."""
    code = """import torch
from paged import _C_cpu as C
C.set_linear_isa("avx512")
gen = torch.Generator().manual_seed(1)
qs = torch.randint(0, 256, (64, 128), generator=gen, dtype=torch.uint8)
d, m = torch.rand(64, 8, generator=gen), torch.rand(64, 8, generator=gen)
p = torch.empty(C.weight_panel_bytes("q4_1", qs, d, m), dtype=torch.uint8)
C.build_weight_panels("q4_1", qs, d, m, p)
for _ in range(2):
    try:
        C.quant_linear(torch.randn(4, 256), "q4_1", qs, d, m, torch.empty(4, 64), "int8", -1, p)
    except ValueError as e:
        print(e)
"""
    env = dict(os.environ, PAGED_NIBBLE_PANEL_ROWS="nine")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    want = "PAGED_NIBBLE_PANEL_ROWS: expected an integer in [1, 8] (0: the CPU's default), got 'nine'"
    assert out.returncode == 0 and out.stdout.splitlines() == [want, want], (out.stdout, out.stderr)


def test_s16_byte_codes_have_no_panels(avx512):
    gen = torch.Generator().manual_seed(2)
    codes = torch.randint(-100, 100, (32, 256), generator=gen, dtype=torch.int8)
    with pytest.raises(ValueError, match="byte codes have no panel layout"):
        C.weight_panel_bytes("s16", codes, torch.rand(32, 16), None)


def test_refused_under_another_build_weight_or_size(avx512):
    gen = torch.Generator().manual_seed(5)
    qs, d, m = random_weight("q4_1", 64, 128, gen)
    panels = build("q4_1", qs, d, m)
    x = torch.randn(12, 128, generator=gen)
    with pytest.raises(ValueError, match=r"panels: expected \d+ bytes for this weight"):
        call(x, "q4_1", qs, d, m, "int8", panels=panels[:-64])
    with pytest.raises(ValueError, match="panels: expected 64-byte aligned data"):
        call(x, "q4_1", qs, d, m, "int8", panels=torch.empty(panels.numel() + 1, dtype=torch.uint8)[1:])
    with pytest.raises(ValueError, match="panels: expected a 1-D uint8 tensor"):
        call(x, "q4_1", qs, d, m, "int8", panels=panels.view(torch.int8))
    same_size = torch.zeros_like(panels)
    with pytest.raises(ValueError, match="panels: expected panels built for this weight under linear ISA 'avx512'"):
        call(x, "q4_1", qs, d, m, "int8", panels=same_size)
    # A same-shape matrix's panels pass the header check (the caller keeps the
    # two together) and are what the kernel reads: the results are theirs.
    qs2, d2, m2 = random_weight("q4_1", 64, 128, gen)
    assert not torch.equal(call(x, "q4_1", qs2, d2, m2, "int8", panels=panels), call(x, "q4_1", qs2, d2, m2, "int8"))
    for name in C.supported_linear_isas():
        if name in ("avx512", "amx"):  # amx reads avx512's layout (test_panels_follow_the_linear_isa)
            continue
        C.set_linear_isa(name)
        assert C.weight_panel_layout() == ""
        with pytest.raises(ValueError, match=f"linear ISA: expected a build with weight panels .*got '{name}'"):
            call(x, "q4_1", qs, d, m, "int8", panels=panels)
        with pytest.raises(ValueError, match="linear ISA: expected a build with weight panels"):
            C.weight_panel_bytes("q4_1", qs, d, m)
    # float32 activations ignore them
    C.set_linear_isa("avx512")
    assert torch.equal(call(x, "q4_1", qs, d, m, "float32", panels=panels), call(x, "q4_1", qs, d, m, "float32"))


# -- CpuPackedLinear, the layer stack and the engine --------------------------


def kquant_weights(config) -> dict:
    """tiny_weights' model with K-quant matrices (their s16 codes packed: K a
    multiple of 256): layer 0 Q5_K with V in Q6_K (its fused QKV mixes the
    two: "s16.s6" with offsets), layer 1 Q6_K."""
    from gguf import GGMLQuantizationType as Q
    from test_quant_layouts import random_blocks

    from paged.core.models.loaders.packed import PackedBlocks

    w = tiny_weights(config)
    for i, (name, t) in enumerate(sorted((k, v) for k, v in w.items() if isinstance(v, PackedBlocks))):
        qtype = Q.Q6_K if ".layers.1." in name or "v_proj" in name else Q.Q5_K
        rows, cols = t.shape
        w[name] = PackedBlocks(qtype, torch.from_numpy(random_blocks(qtype, rows, cols, seed=i)), (rows, cols))
    return w


def tiny_model(activations, panels: str, monkeypatch, kquants: bool = False, row_parts: bool = False):
    monkeypatch.setenv("PAGED_CPU_WEIGHT_PANELS", panels)
    if row_parts:  # test_row_parts' model: a QKV of Q4_K Q/K rows (q4_1) and Q6_K V rows (s16)
        import test_row_parts

        config = test_row_parts.tiny_config()
        weights = test_row_parts.tiny_weights(config)
    else:
        config = tiny_config(hidden_size=256, intermediate_size=512, num_heads=8, head_dim=32) if kquants \
            else tiny_config()
        weights = kquant_weights(config) if kquants else tiny_weights(config)
    backend = CpuBackend(config.num_heads, config.num_kv_heads, config.head_dim, BLOCK, torch.float32, "cpu")
    if row_parts:  # a packed linear that says it takes row parts (else the loader joins them as s16)
        from paged.backends.cpu.precision import PlannedPackedLinear, PrecisionPlan

        linear = PlannedPackedLinear(PrecisionPlan(activations))
    else:
        linear = lambda t: ql.CpuPackedLinear(t, activations=activations)  # noqa: E731
    model = build_model(config, weights, torch.float32, "cpu", backend, linear)
    prepare_model(model)
    return model, backend


def built(model) -> list[bool]:
    return [layer.gate_up._panels is not None for layer in model.layers]


# a prompt step, then decodes beside a prompt chunk: calls of more than 8 rows
PANEL_STEPS = [([(0, 0, 3), (1, 0, 17), (2, 0, 9), (3, 0, 20), (4, 0, 5)], 0),
               ([(0, 3, 1), (1, 17, 1), (2, 9, 1), (4, 5, 1), (3, 20, 10)], 4)]


def assert_steps_match(on, off, seed: int, steps, monkeypatch):
    """(model, backend) pairs `on` and `off` run `steps` (step_inputs' work
    lists) through the layer stack and the Python layers: the same hidden
    states and KV caches, bit for bit."""
    rng = np.random.default_rng(seed)
    tokens = [rng.integers(0, 96, size=n + 12).tolist() for n in LENGTHS]
    for stack in ("1", "0"):
        monkeypatch.setenv("PAGED_LAYER_STACK", stack)
        caches = [b.allocate_kv_cache(len(m.layers), len(LENGTHS) * MAX_BLOCKS) for m, b in (on, off)]
        for work, nd in steps:
            ids, pos, meta = step(tokens, work, nd)
            meta.first_prompt_row = int(meta.query_start_loc[nd])
            got, want = on[0](ids, pos, caches[0], meta), off[0](ids, pos, caches[1], meta)
            assert torch.isfinite(want).all() and torch.equal(got, want), (stack, work)
        for (k1, v1), (k0, v0) in zip(*caches):
            assert torch.equal(k1, k0) and torch.equal(v1, v0)


@pytest.mark.parametrize("activations", ["int8", "mixed"])
@pytest.mark.parametrize("kquants", [False, True], ids=["q4-q8", "k-quants"])
def test_model_steps_are_bitwise_the_same_with_and_without_panels(avx512, activations, kquants, monkeypatch):
    """Prompt and decode steps of more than 8 rows, through the Python layers
    and the layer stack, with panels (planned at load) and without."""
    on, ob = tiny_model(activations, "1", monkeypatch, kquants)
    off, fb = tiny_model(activations, "0", monkeypatch, kquants)
    assert all(built(on)) and not any(built(off))
    if kquants:
        assert {layer.qkv.kernel_qtype for layer in on.layers} == {"s16.s6"}
        assert {layer.gate_up.kernel_qtype for layer in on.layers} == {"s16.u5", "s16.s6"}
    assert on.layer_stack is not None
    assert_steps_match((on, ob), (off, fb), 11, PANEL_STEPS, monkeypatch)


@pytest.mark.parametrize("activations", ["int8", "mixed"])
def test_row_parts_have_panels_of_their_own(avx512, activations, monkeypatch):
    """A fused QKV of row parts (Q4_K_M's: Q/K in q4_1, V in s16) keeps one
    panel per part in place of its arrays; prompt and decode steps through
    the layer stack and the Python layers are bitwise those without panels."""
    on, ob = tiny_model(activations, "1", monkeypatch, row_parts=True)
    off, fb = tiny_model(activations, "0", monkeypatch, row_parts=True)
    parts = [p for layer in on.layers for p in layer.qkv.parts]
    assert {p.kernel_qtype for p in parts} == {"q4_1", "s16.s6"}
    assert all(p.use_panels and p.packed_released for p in parts)
    assert not any(p.use_panels for layer in off.layers for p in layer.qkv.parts)
    assert_steps_match((on, ob), (off, fb), 12, PANEL_STEPS + [([(0, 4, 1)], 1)], monkeypatch)  # one row too


def test_panels_follow_the_linear_isa(avx512, monkeypatch):
    model, backend = tiny_model("int8x2", "1", monkeypatch)
    w = model.layers[0].gate_up
    x = torch.randn(12, w.in_features, generator=torch.Generator().manual_seed(2))
    first = w.weight_panels()
    assert w._panels_layout == "avx512/5"
    with_panels = w.linear(x)
    w.use_panels = False
    assert w.weight_panels() is None and torch.equal(w.linear(x), with_panels)
    w.use_panels = True
    if "amx" in C.supported_linear_isas():  # reads avx512's panels as they lie: the same tensor
        C.set_linear_isa("amx")
        assert C.weight_panel_layout() == "avx512/5" and w.weight_panels() is first
        assert torch.equal(w.linear(x), with_panels)
    others = [name for name in C.supported_linear_isas() if name not in ("avx512", "amx")]
    for name in others:  # no layout: no panels; the stack leaves its avx512 tensors unused
        C.set_linear_isa(name)
        assert w.weight_panels() is None
        ids, pos, meta = step([list(range(20))], [(0, 0, 20)], 0)
        outs = []
        for stack in ("1", "0"):
            monkeypatch.setenv("PAGED_LAYER_STACK", stack)
            outs.append(model(ids, pos, backend.allocate_kv_cache(len(model.layers), MAX_BLOCKS), meta))
        assert torch.equal(outs[0], outs[1]), name
    C.set_linear_isa("avx512")
    assert w.weight_panels() is first  # the same build's layout: kept


def test_panels_replace_the_packed_arrays(avx512, monkeypatch):
    """Planned panels hold the only copy of each matrix (release_packed): the
    model's steps are bitwise those of a model without panels under the
    panels' build, through the stack and the Python layers; under a build
    without panels the stack declines and the Python layers unpack the
    arrays again, bitwise what that build computes without panels."""
    on, ob = tiny_model("int8x2", "1", monkeypatch)
    off, fb = tiny_model("int8x2", "0", monkeypatch)
    mats = [w for layer in on.layers for w in (layer.qkv, layer.o_proj, layer.gate_up, layer.down) if not w.parts]
    assert mats and all(w.packed_released for w in mats) and not off.layers[0].down.packed_released
    ids, pos, meta = step([list(range(20))], [(0, 0, 20)], 0)
    others = [name for name in C.supported_linear_isas() if name not in ("avx512", "amx")]
    for name in ["avx512"] + others:
        C.set_linear_isa(name)
        assert on.layer_stack.handles(20) == (name == "avx512")
        for stack in ("1", "0"):
            monkeypatch.setenv("PAGED_LAYER_STACK", stack)
            got = on(ids, pos, ob.allocate_kv_cache(len(on.layers), MAX_BLOCKS), meta)
            want = off(ids, pos, fb.allocate_kv_cache(len(off.layers), MAX_BLOCKS), meta)
            assert torch.equal(got, want), (name, stack)
    assert others == [] or not on.layers[0].down.packed_released  # unpacked for the other build, kept


def test_plan_policy(avx512, monkeypatch):
    model, _ = tiny_model("int8", "0", monkeypatch)
    mats = [layer.down for layer in model.layers]
    monkeypatch.setenv("PAGED_CPU_WEIGHT_PANELS", "0")
    assert ql.plan_weight_panels(mats) == 0 and not any(w.use_panels or w.packed_released for w in mats)
    want = sum(C.weight_panel_bytes(w.qtype, w.qs, w.d, w.m) for w in mats)
    monkeypatch.setenv("PAGED_CPU_WEIGHT_PANELS", "auto")  # at any size: they replace the packed arrays
    assert ql.plan_weight_panels(mats) == want and all(w.use_panels and w.packed_released for w in mats)
    exact, _ = tiny_model("float32", "1", monkeypatch)  # the float32 paths have no panels
    assert ql.plan_weight_panels([layer.down for layer in exact.layers]) == 0
    assert not exact.layers[0].down.use_panels and exact.layers[0].down.weight_panels() is None
    monkeypatch.setenv("PAGED_CPU_WEIGHT_PANELS", "yes")
    with pytest.raises(ValueError, match=r"PAGED_CPU_WEIGHT_PANELS: expected '0', '1' or 'auto', got 'yes'"):
        ql.plan_weight_panels(mats)


def test_engine_greedy_output_is_the_same_with_and_without_panels(avx512, default_model_path, monkeypatch):
    """Ten sequences decode together (10 rows per step: the panel path)."""
    from paged.core.entrypoints.llm import LLM
    from paged.core.engine.sampling_params import SamplingParams

    prompts = [f"Question {i}: what is {i} plus {i + 3}? Answer:" for i in range(10)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    texts = {}
    for panels in ("0", "1"):
        monkeypatch.setenv("PAGED_CPU_WEIGHT_PANELS", panels)
        llm = LLM(str(default_model_path), device="cpu", max_model_len=256, max_num_seqs=16,
                  kv_cache_memory="64MiB")
        gate_up = llm.engine.runner.model.layers[0].gate_up
        assert (gate_up._panels is not None) == (panels == "1")
        texts[panels] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert texts["0"] == texts["1"]


def test_auto_gives_compact_scales_panels_of_their_packed_size(avx512, monkeypatch):
    """A compact-scale matrix (Q4_K as q4_1) gets its persistent panel under "auto"
    like a float-scale one, as large as its codes and compact scales (they stay
    compact in it), and the same bits with it as without."""
    from gguf import GGMLQuantizationType as Q
    from test_quant_layouts import random_blocks

    from paged.core.models.loaders.packed import PackedBlocks

    compact = ql.CpuPackedLinear(PackedBlocks(Q.Q4_K, torch.from_numpy(random_blocks(Q.Q4_K, 64, 512, 3)),
                                              (64, 512)), "int8x2")
    plain = ql.CpuPackedLinear(PackedBlocks(Q.Q4_1, torch.from_numpy(random_blocks(Q.Q4_1, 64, 512, 4)),
                                            (64, 512)), "int8x2")
    assert compact.d.dtype == torch.uint8 and plain.d.dtype == torch.float32  # compact scales beside float ones
    assert compact.qtype == plain.qtype == "q4_1"
    x = torch.randn(3, 512)
    before = compact.linear(x)
    monkeypatch.setenv("PAGED_CPU_WEIGHT_PANELS", "auto")
    total = ql.plan_weight_panels([compact, plain])
    assert compact.use_panels and plain.use_panels
    assert total == compact.weight_panels().numel() + plain.weight_panels().numel()
    held = sum(t.numel() * t.element_size() for t in (compact.qs, compact.d, compact.m))  # codes, compact scales
    supers = 2 * 64 * (512 // 256)  # d's and m's, a float32 per 256 weights of each row in the arrays
    assert compact.weight_panels().numel() == held - 2 * supers + 64  # fp16 supers in the panel, and the header
    assert int(compact.weight_panels()[56]) == 4  # PanelScales::CompactF16
    assert torch.equal(compact.linear(x), before)  # same bits with the panel


def test_compact_supers_that_are_not_fp16_stay_float32(avx512):
    """Compact scales whose supers are not all fp16 values (never GGUF's, but
    the arrays allow them) keep float32 supers in the panel (PanelScales::Compact):
    the packed size, the same bits as without the panel, and unpacked byte for byte."""
    from gguf import GGMLQuantizationType as Q
    from test_quant_layouts import random_blocks

    from paged.core.models.loaders.packed import PackedBlocks

    w = ql.CpuPackedLinear(PackedBlocks(Q.Q4_K, torch.from_numpy(random_blocks(Q.Q4_K, 40, 512, 5)), (40, 512)),
                           "int8x2")
    assert w.qtype == "q4_1" and w.d.dtype == torch.uint8
    qs, d, m = w.qs, w.d.clone(), w.m.clone()
    row_scales = 512 // 32
    supers = d[:, row_scales:].contiguous().view(torch.float32)  # each row: 16 bytes, then 2 float32 supers
    supers[7, 1] *= 1 + 2**-20  # no longer an fp16 value
    d[:, row_scales:] = supers.view(torch.uint8)
    panels = build("q4_1", qs, d, m)
    assert int(panels[56]) == 2  # PanelScales::Compact: float32 supers
    held = sum(t.numel() * t.element_size() for t in (qs, d, m))
    assert panels.numel() - 64 == held * 64 // 40  # 40 rows in 2 chunks of 32, float32 supers as in the arrays
    gen = torch.Generator().manual_seed(8)
    for rows in (1, 5, 33):
        x = torch.randn(rows, 512, generator=gen)
        for act in ("int8", "int8x2"):
            assert torch.equal(call(x, "q4_1", qs, d, m, act, -1, panels), call(x, "q4_1", qs, d, m, act))
    back = [torch.empty_like(t) for t in (qs, d, m)]
    C.unpack_weight_panels("q4_1", panels, *back)
    assert all(torch.equal(t, u) for t, u in zip((qs, d, m), back))


def packed_like(qs, d, m):
    return torch.empty_like(qs), torch.empty_like(d), None if m is None else torch.empty_like(m)


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("fp16_scales", [True, False], ids=["fp16-scales", "float32-scales"])
def test_unpack_gives_back_the_weight_under_any_build(avx512, qtype, fp16_scales):
    """unpack_weight_panels is build_weight_panels' inverse, bit for bit (codes,
    scales in either form, a partial last chunk), also after a switch to a
    build without panels (a matrix that keeps only its panels needs its
    arrays back there)."""
    gen = torch.Generator().manual_seed(8)
    qs, d, m = random_weight(qtype, 72, 8 * 32 + 64, gen)
    if not fp16_scales:
        d = d * (1 + 2**-20)
    panels = build(qtype, qs, d, m)
    for isa in ("avx512", "avx2"):
        C.set_linear_isa(isa)
        got = packed_like(qs, d, m)
        C.unpack_weight_panels(qtype, panels, *got)
        for a, b in zip(got, (qs, d, m)):
            assert (a is None and b is None) or torch.equal(a.view(torch.uint8), b.view(torch.uint8)), isa
    C.set_linear_isa("avx512")
    with pytest.raises(ValueError, match="panels: expected panels built for this weight"):
        C.unpack_weight_panels(qtype, panels, *packed_like(*random_weight(qtype, 40, 8 * 32, gen)))  # another K


def test_unpack_gives_back_compact_scales():
    from gguf import GGMLQuantizationType as Q
    from test_quant_layouts import random_blocks

    from paged.core.models.loaders.quant_layouts import unpack

    C.set_linear_isa("avx512")
    try:
        layout, qs, d, m = unpack(Q.Q4_K, torch.from_numpy(random_blocks(Q.Q4_K, 40, 512, 5)), (40, 512))
        assert d.dtype == torch.uint8
        panels = build(layout, qs, d, m)
        got = packed_like(qs, d, m)
        C.unpack_weight_panels(layout, panels, *got)
        assert all(torch.equal(a, b) for a, b in zip(got, (qs, d, m)))
    finally:
        C.set_linear_isa("auto")


def test_unpack_rows_and_lookups_from_panels(avx512, monkeypatch):
    """unpack_weight_panels' first_row gives a chunk's rows alone, and an
    embedding lookup of a matrix that keeps only its panels unpacks just its
    rows' chunks: gguf's values (the unreleased twin's), still released after."""
    from gguf import GGMLQuantizationType as Q
    from test_quant_layouts import random_blocks

    from paged.core.models.loaders.packed import PackedBlocks

    for qtype in (Q.Q8_0, Q.Q4_K):
        blocks = PackedBlocks(qtype, torch.from_numpy(random_blocks(qtype, 72, 512, 6)), (72, 512))
        kept, released = (ql.CpuPackedLinear(blocks, "int8x2") for _ in range(2))
        released.use_panels = True
        assert released.release_packed() > 0 and released.packed_released
        qs, d, m = kept.qs, kept.d, kept.m
        for first, n in ((32, 32), (64, 8)):
            got = [None if t is None else torch.empty((n, *t.shape[1:]), dtype=t.dtype) for t in (qs, d, m)]
            C.unpack_weight_panels(kept.qtype, released._panels, *got, first)
            assert all(g is None or torch.equal(g, t[first:first + n]) for g, t in zip(got, (qs, d, m)))
        with pytest.raises(ValueError, match="first_row: expected a multiple of 32"):
            C.unpack_weight_panels(kept.qtype, released._panels, *(None if t is None else t[:8].clone()
                                                                   for t in (qs, d, m)), 16)
        ids = torch.tensor([[71, 0, 33], [5, 71, 40]])
        assert torch.equal(released.embedding(ids), kept.embedding(ids)) and released.packed_released
