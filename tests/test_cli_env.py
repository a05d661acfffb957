"""The paged CLI, run as a real subprocess (python -m and the console
script), plus the dispatcher's error handling with small command modules."""

import json
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from paged.core.entrypoints import cli

CONSOLE_SCRIPT = Path(sys.executable).with_name("paged")


def paged(*args, script=False, **kwargs):
    cmd = [str(CONSOLE_SCRIPT)] if script else [sys.executable, "-m", "paged.core.entrypoints.cli"]
    env = {k: v for k, v in os.environ.items() if k != "PAGED_DEVICE"}
    return subprocess.run(cmd + list(args), capture_output=True, text=True, timeout=120, env=env, **kwargs)


def assert_one_line_error(result, *fragments):
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("paged: error: "), result.stderr
    assert "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in lines[0]


def test_env_text():
    result = paged("env")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert out.startswith("platform        cpu")
    assert "paged._C_cpu    ok" in out
    assert "binding         --cpu-threads-bind auto" in out
    assert "  thread 0      on cpu" in out
    assert "cpu features    " in out and "kv cache budget " in out
    assert "linear          --linear-activations auto = mixed" in out


def test_env_json_from_console_script():
    if not CONSOLE_SCRIPT.exists():
        pytest.skip(f"console script not installed at {CONSOLE_SCRIPT}")
    allowed = sorted(os.sched_getaffinity(0))
    result = paged("env", "--json", "--device", "cpu", "--cpu-threads-bind", str(allowed[-1]), script=True)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["platform"] == "cpu" and report["torch"]
    assert report["compiled_modules"]["paged._C_cpu"].startswith("ok")
    assert report["binding"]["cpus"] == str(allowed[-1])
    assert report["threads"] == [{"thread": 0, "cpu": allowed[-1], "affinity": [allowed[-1]]}]
    assert report["topology"]["usable_cpus"]
    assert set(report["cpu_features"]) >= {"avx2", "avx512f", "avx512bf16", "avx512vnni", "amx"}
    # auto's linear mode follows the CPU (mixed-bf16 needs AMX-BF16), as the engine resolves it
    from paged.backends.cpu.quant_linear import bf16_prompt_supported

    assert report["linear_activations"] == ("mixed-bf16" if bf16_prompt_supported() else "mixed")


def _device_unavailable(name):
    from paged.platforms import PlatformUnavailable, get_platform

    try:
        get_platform(name)
    except PlatformUnavailable:
        return True
    return False


@pytest.mark.parametrize("args", [("--device", "cuda", "env"), ("env", "--device", "npu")])
def test_unavailable_device_exits_2_with_one_line(args):
    if not _device_unavailable(args[1] if args[0] == "--device" else args[2]):
        pytest.skip("that device is available on this machine")
    assert_one_line_error(paged(*args), "platform '")


@pytest.mark.parametrize("bind, fragment", [("5-2", "is reversed"), ("4096", "not allowed for this process")])
def test_bad_cpu_threads_bind_exits_2(bind, fragment):
    # malformed lists in general are covered in process by test_topology.py
    result = paged("--device", "cpu", "env", "--cpu-threads-bind", bind)
    assert_one_line_error(result, "--cpu-threads-bind", fragment)


def _limit_data_to_1gib():
    resource.setrlimit(resource.RLIMIT_DATA, (2**30, 2**30))


def test_huge_cpu_range_exits_2_within_1gib():
    # 0-99999999 used to be expanded into a list first: ~4 GB, MemoryError here
    result = paged("--device", "cpu", "env", "--cpu-threads-bind", "0-99999999", preexec_fn=_limit_data_to_1gib)
    assert_one_line_error(result, "--cpu-threads-bind", "-99999999 in CPU list '0-99999999' is not allowed")


# ---- dispatcher behaviour, in process, with tiny command modules ----------

COMMAND_SOURCE = '''
def add_arguments(parser):
    parser.add_argument("--fail", default=None)

def run(args):
    if args.fail == "value":
        raise ValueError("bad --fail value\\nsecond line")
    if args.fail == "file":
        raise FileNotFoundError("no such model: /nope")
    if args.fail == "bug":
        raise KeyError("a real bug")
    print("ran on", args.device, args.platform.name)
    return 0
'''


@pytest.fixture
def toy_command(tmp_path, monkeypatch):
    (tmp_path / "paged_toy_command.py").write_text(COMMAND_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(cli.COMMANDS, "toy", cli.Command("paged_toy_command", "a test command"))
    monkeypatch.delenv("PAGED_DEVICE", raising=False)
    yield
    sys.modules.pop("paged_toy_command", None)


def test_device_before_or_after_command(toy_command, capsys):
    assert cli.main(["--device", "cpu", "toy"]) == 0
    assert capsys.readouterr().out.strip() == "ran on cpu cpu"
    assert cli.main(["toy", "--device", "auto"]) == 0
    assert capsys.readouterr().out.strip().startswith("ran on ")


@pytest.mark.parametrize("fail, fragment", [("value", "bad --fail value second line"),
                                            ("file", "no such model: /nope")])
def test_user_errors_are_one_line(toy_command, capsys, fail, fragment):
    assert cli.main(["toy", "--fail", fail]) == 2
    err = capsys.readouterr().err
    assert err == f"paged: error: {fragment}\n"


def test_unexpected_errors_keep_their_traceback(toy_command):
    with pytest.raises(KeyError, match="a real bug"):
        cli.main(["toy", "--fail", "bug"])


def test_missing_command_module(monkeypatch, capsys):
    monkeypatch.setitem(cli.COMMANDS, "bench", cli.Command("paged.core.no_such_bench_cli", "bench"))
    assert cli.main(["bench"]) == 2
    assert capsys.readouterr().err == \
        "paged: error: command 'bench' is not available in this build (paged.core.no_such_bench_cli is missing)\n"


def test_unknown_command_and_no_command(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["frobnicate"])
    assert info.value.code == 2
    with pytest.raises(SystemExit) as info:
        cli.main([])
    assert info.value.code == 2
    assert "<command>" in capsys.readouterr().err
