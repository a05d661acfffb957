"""The one CPU-feature detector (csrc_cpu/runtime/cpu_features.cpp) and its
PAGED_CPU_HIDE override. Oracles: the kernel's own /proc/cpuinfo flags, and
what each kernel family selects in a child process run with features hidden."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from paged import _C_cpu
from paged.backends.cpu.host import isa as cpu_isa

# our feature name -> the Linux /proc/cpuinfo flag, per architecture
ARM_CPUINFO_FLAG = {"asimd": "asimd", "fp16": "asimdhp", "dotprod": "asimddp", "i8mm": "i8mm", "bf16": "bf16",
                    "sve": "sve", "sve2": "sve2"}
X86_CPUINFO_FLAG = {"avx2": "avx2", "fma": "fma", "f16c": "f16c", "avxvnni": "avx_vnni", "avx512f": "avx512f",
                "avx512bw": "avx512bw", "avx512vl": "avx512vl", "avx512dq": "avx512dq",
                "avx512vnni": "avx512_vnni", "avx512bf16": "avx512_bf16", "avx512fp16": "avx512_fp16",
                "amx_tile": "amx_tile", "amx_bf16": "amx_bf16", "amx_int8": "amx_int8"}
CPUINFO_FLAG = ARM_CPUINFO_FLAG if cpu_isa.machine_arch() == "aarch64" else X86_CPUINFO_FLAG


def cpuinfo_flags() -> set[str]:
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
            if line.startswith("Features"):  # aarch64
                return set(line.split(":", 1)[1].split())
    pytest.skip("/proc/cpuinfo has no flags line (not Linux on x86 or aarch64)")


def child(code: str, hide: str | None, *argv: str) -> subprocess.CompletedProcess:
    """``python -c code argv...`` with PAGED_CPU_HIDE=hide (None: nothing hidden)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PAGED_CPU_HIDE", "PAGED_CPU_ISA")}
    if hide is not None:
        env["PAGED_CPU_HIDE"] = hide
    return subprocess.run([sys.executable, "-c", code, *argv], env=env, capture_output=True, text=True,
                          timeout=120)


REPORT = ("import json; from paged import _C_cpu as C; from paged.backends.cpu.host import isa as cpu_isa; "
          "print(json.dumps({'features': C.cpu_features(), 'hidden': C.hidden_cpu_features(), "
          "'builds': cpu_isa.active_builds(), 'levels': cpu_isa.supported_levels()}))")


def test_detector_agrees_with_proc_cpuinfo():
    if os.environ.get("PAGED_CPU_HIDE"):
        pytest.skip("PAGED_CPU_HIDE is set for this run")
    flags = cpuinfo_flags()
    features = _C_cpu.cpu_features()
    for ours, flag in CPUINFO_FLAG.items():
        assert features[ours] == (flag in flags), f"{ours}: detector {features[ours]}, /proc/cpuinfo {flag in flags}"


@pytest.mark.parametrize("level", cpu_isa.LEVELS)
def test_hiding_moves_every_family_to_the_level(level):
    if level not in cpu_isa.supported_levels():
        pytest.skip(f"this CPU cannot run the {level} level")
    out = child(REPORT, cpu_isa.hide_env(level)["PAGED_CPU_HIDE"])
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout)
    assert seen["levels"][0] == level
    assert seen["builds"] == cpu_isa.builds_for_level(level)
    if level != "avx512":
        assert not seen["features"]["avx512f"] and not seen["features"]["avx512bf16"]
    if level == "scalar":
        assert set(seen["builds"].values()) == {"scalar"} and not seen["features"]["avx2"]


def test_hiding_a_feature_hides_what_needs_it():
    out = child(REPORT, "avx512f")
    seen = json.loads(out.stdout)
    assert not any(v for k, v in seen["features"].items() if k.startswith(("avx512", "amx")))
    # what the hardware has (this process may itself run with features hidden)
    hardware = {k for k, v in _C_cpu.cpu_features().items() if v} | set(_C_cpu.hidden_cpu_features())
    assert set(seen["hidden"]) == {k for k in hardware if k.startswith(("avx512", "amx")) and k != "amx"}


def test_bad_hide_is_a_one_line_error():
    out = child("from paged.platforms.cpu import CpuPlatform; print(CpuPlatform().is_available().reason)",
                "avx512,sse9")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().startswith("PAGED_CPU_HIDE: expected a comma-separated list of")
    assert "got 'sse9'" in out.stdout


def test_features_are_the_running_architectures_and_hiding_takes_either():
    """cpu_features() lists this architecture's names only; PAGED_CPU_HIDE
    knows both architectures' names, so one value serves x86 and ARM hosts."""
    names = set(_C_cpu.cpu_features())
    ours, other = ((ARM_CPUINFO_FLAG, X86_CPUINFO_FLAG) if cpu_isa.machine_arch() == "aarch64"
                   else (X86_CPUINFO_FLAG, ARM_CPUINFO_FLAG))
    assert set(ours) <= names and not set(other) & names
    plain, hiding_other = child(REPORT, None), child(REPORT, ",".join(other))
    assert plain.returncode == 0 and hiding_other.returncode == 0, plain.stderr + hiding_other.stderr
    plain, hiding_other = json.loads(plain.stdout), json.loads(hiding_other.stdout)
    assert hiding_other["hidden"] == [] and hiding_other["builds"] == plain["builds"]


def test_levels_per_architecture():
    assert cpu_isa.machine_arch("AMD64") == "x86_64" and cpu_isa.machine_arch("arm64") == "aarch64"
    arch = cpu_isa.machine_arch()
    expected = {"x86_64": ("avx512", "avx2", "scalar"), "aarch64": ("i8mm", "dotprod", "neon", "scalar")}
    assert cpu_isa.LEVELS == expected.get(arch, ("scalar",))
    assert cpu_isa.supported_levels()[-1] == "scalar"


def test_use_level_sets_and_restores_every_family():
    before = cpu_isa.active_builds()
    for level in cpu_isa.supported_levels():
        with cpu_isa.use_level(level) as chosen:
            assert cpu_isa.active_builds() == chosen == cpu_isa.builds_for_level(level)
        assert cpu_isa.active_builds() == before
    with pytest.raises(ValueError, match=f"level: expected one of {', '.join(cpu_isa.LEVELS)}, got 'sse'"):
        cpu_isa.builds_for_level("sse")


def test_env_shows_the_builds_next_to_the_flags():
    level = "avx2" if "avx2" in cpu_isa.supported_levels() else "scalar"
    out = child("import sys; from paged.core.entrypoints.cli import main; sys.exit(main())",
                cpu_isa.hide_env(level)["PAGED_CPU_HIDE"], "--device", "cpu", "env")
    assert out.returncode == 0, out.stderr
    builds = cpu_isa.builds_for_level(level)
    assert "kernel builds   " + ", ".join(f"{k} {v}" for k, v in builds.items()) in out.stdout
    if _C_cpu.cpu_features()["avx512f"]:
        # the hidden line lists features in the detector's order (avxvnni,
        # where the CPU has it, comes before avx512f)
        hidden = [line.split()[1:] for line in out.stdout.splitlines() if line.split()[:1] == ["hidden"]]
        assert "avx512f-" in out.stdout and hidden and "avx512f" in hidden[0], out.stdout


# -- the kernel build table (csrc_cpu/kernel_builds.cpp) ------------------------------
SELECTABLE = {"attention": ("attention_isa", "supported_attention_isas"),
              "linear": ("linear_isa", "supported_linear_isas"),
              "fused_ops": ("fused_ops_isa", "supported_fused_ops_isas")}
#: families that run the first build the CPU allows -> the entry point saying whether one runs
FOLLOWING = {"lanes_prompt_attention": "lanes_prompt_attention_supported",
             "bf16_prompt_attention": "bf16_prompt_attention_supported",
             "bf16_prompt_rows": "bf16_prompt_supported", "f16_cache_row": None}


def test_table_lists_every_family_with_levels_of_this_architecture():
    table, levels = _C_cpu.kernel_builds(), _C_cpu.kernel_levels()
    assert set(table) == set(SELECTABLE) | set(FOLLOWING)
    assert tuple(level["name"] for level in levels) == cpu_isa.LEVELS
    runs = [level["runs"] for level in levels]
    assert runs == sorted(runs) and runs[-1], runs  # a CPU of a level runs every lower one
    for family, entry in table.items():
        assert entry["selectable"] == (family in SELECTABLE), family
        for b in entry["builds"]:
            assert b["level"] in cpu_isa.LEVELS, (family, b)
            assert not b["active"] or b["runs"], (family, b)
        assert sum(b["active"] for b in entry["builds"]) <= 1, (family, entry)


def test_table_agrees_with_the_selectors_and_entry_points():
    table = _C_cpu.kernel_builds()
    for family, (current, supported) in SELECTABLE.items():
        builds = table[family]["builds"]
        assert builds[-1]["name"] == "scalar" and builds[-1]["runs"]
        assert [b["name"] for b in builds if b["runs"]] == getattr(_C_cpu, supported)()
        assert [b["name"] for b in builds if b["active"]] == [getattr(_C_cpu, current)()]
    for family, supported in FOLLOWING.items():
        active = any(b["active"] for b in table[family]["builds"])
        if supported:
            assert active == bool(getattr(_C_cpu, supported)()), family
        else:
            assert active, family  # the float16 cache write has a scalar build


def test_lanes_prompt_attention_follows_the_attention_level():
    """Active only while attention runs a build of its level: a forced lower
    attention build keeps the float32 prompt kernel."""
    lanes = lambda: [b for b in _C_cpu.kernel_builds()["lanes_prompt_attention"]["builds"] if b["active"]]  # noqa: E731
    for level in cpu_isa.supported_levels():
        with cpu_isa.use_level(level):
            active = lanes()
            assert all(cpu_isa.LEVELS.index(b["level"]) >= cpu_isa.LEVELS.index(level) for b in active)
            assert bool(active) == bool(_C_cpu.lanes_prompt_attention_supported())


def test_set_kernel_build_names_the_families_it_takes():
    with pytest.raises(ValueError, match="family: expected one of attention, linear, fused_ops .*got 'f16_cache_row'"):
        _C_cpu.set_kernel_build("f16_cache_row", "scalar")
    with pytest.raises(ValueError, match="attention ISA: expected one of auto"):
        _C_cpu.set_kernel_build("attention", "avx9000")
    try:
        _C_cpu.set_kernel_build("fused_ops", "scalar")
        assert _C_cpu.fused_ops_isa() == "scalar"
    finally:
        _C_cpu.set_kernel_build("fused_ops", "auto")


def test_hiding_a_level_shows_in_the_table():
    """A child at each level: no build above it runs, and the levels it runs start there."""
    code = "import json; from paged import _C_cpu as C; print(json.dumps([C.kernel_builds(), C.kernel_levels()]))"
    for level in cpu_isa.supported_levels():
        out = child(code, cpu_isa.hide_env(level)["PAGED_CPU_HIDE"])
        assert out.returncode == 0, out.stderr
        table, levels = json.loads(out.stdout)
        assert [entry["name"] for entry in levels if entry["runs"]][0] == level
        cap = cpu_isa.LEVELS.index(level)
        for family, entry in table.items():
            for b in entry["builds"]:
                assert not b["runs"] or cpu_isa.LEVELS.index(b["level"]) >= cap, (level, family, b)
