"""Registry: built-ins, a real entry-point plugin on sys.path, auto order,
one-line unavailability messages, import hygiene."""

import subprocess
import sys
import textwrap

import pytest

import paged.platforms as platforms
from paged.platforms import PlatformUnavailable, registry
from paged.platforms.cpu import CpuPlatform

PLUGIN_SOURCE = '''
from paged.platforms.base import Availability, MemoryInfo, Platform


class ToyPlatform(Platform):
    name = "toy"
    device_type = "cpu"

    def is_available(self):
        return Availability(True)

    def device_count(self):
        return 1

    def memory_info(self):
        return MemoryInfo(1 << 30, 1 << 29)

    def supported_dtypes(self):
        import torch
        return [torch.float32]


class MissingChipPlatform(ToyPlatform):
    name = "missingchip"

    def is_available(self):
        return Availability(False, "no MissingChip driver found:\\ninstall missingchip-runtime")


NOT_A_PLATFORM = object()
'''


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    """A real installed-looking distribution: module + dist-info with entry points."""
    (tmp_path / "paged_toy_plugin.py").write_text(PLUGIN_SOURCE)
    dist = tmp_path / "paged_toy_plugin-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: paged-toy-plugin\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(textwrap.dedent("""\
        [paged.platforms]
        toy = paged_toy_plugin:ToyPlatform
        missingchip = paged_toy_plugin:MissingChipPlatform
        broken = paged_toy_plugin_does_not_exist:Whatever
        notaplatform = paged_toy_plugin:NOT_A_PLATFORM
        cpu = paged_toy_plugin:ToyPlatform
        """))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    sys.modules.pop("paged_toy_plugin", None)


def test_cpu_builtin():
    platform = platforms.get_platform("cpu")
    assert isinstance(platform, CpuPlatform)
    assert (platform.name, platform.device_type, platform.dist_backend, platform.default_block_size) == \
        ("cpu", "cpu", "gloo", 128)
    assert platform.device_count() == 1


def test_auto_picks_first_available_in_order():
    chosen = platforms.get_platform("auto")
    expected = None
    assert platforms.auto_order() == ["cuda", "npu", "cpu"]  # from each class's auto_priority
    for name in platforms.auto_order():  # the oracle: walk the order by hand
        cls = platforms.list_platforms()[name]
        if isinstance(cls, type) and cls().is_available().ok:
            expected = name
            break
    assert chosen.name == expected


def test_entry_point_plugin_is_discovered(plugin):
    listed = platforms.list_platforms()
    import paged_toy_plugin

    assert listed["toy"] is paged_toy_plugin.ToyPlatform
    assert listed["cpu"] is CpuPlatform  # a plugin cannot shadow a built-in
    assert "paged_toy_plugin_does_not_exist" in listed["broken"]
    toy = platforms.get_platform("toy")
    assert toy.name == "toy" and toy.memory_info().available_bytes == 1 << 29


@pytest.mark.parametrize("name, message", [
    ("missingchip", "platform 'missingchip' is not available: no MissingChip driver found: install missingchip-runtime"),
    ("broken", "platform 'broken' is not part of this build|needs the Python package 'paged_toy_plugin_does_not_exist'"),
    ("notaplatform", "does not load a Platform subclass"),
    ("nosuchthing", "unknown platform 'nosuchthing' .*known: cpu, cuda, npu, broken, missingchip, notaplatform, toy"),
])
def test_unavailable_platform_is_one_line(plugin, name, message):
    with pytest.raises(PlatformUnavailable, match=message) as info:
        platforms.get_platform(name)
    assert "\n" not in str(info.value)


def test_builtins_are_entry_points_of_paged_itself():
    """No central list: cpu, cuda and npu come from paged's own entry points,
    as a plugin's do (pyproject.toml)."""
    from importlib import metadata

    eps = {ep.name: ep.value for ep in metadata.entry_points(group=platforms.ENTRY_POINT_GROUP)
           if ep.dist is not None and ep.dist.metadata["Name"] == "paged"}
    assert eps == {"cpu": "paged.platforms.cpu:CpuPlatform", "cuda": "paged.platforms.cuda:CudaPlatform",
                   "npu": "paged.platforms.npu:NpuPlatform"}
    assert platforms.builtin_names() == ["cpu", "cuda", "npu"]
    assert not hasattr(registry, "BUILTIN_PLATFORMS")


def test_missing_builtin_module_is_one_line(monkeypatch):
    real = registry.registered()
    ep = real["cuda"].entry_point
    broken = registry.Registered("cuda", "paged.platforms.no_such_module:CudaPlatform", True,
                                 type(ep)("cuda", "paged.platforms.no_such_module:CudaPlatform", ep.group))
    monkeypatch.setattr(registry, "registered", lambda: {**real, "cuda": broken})
    with pytest.raises(PlatformUnavailable, match=r"^platform 'cuda' is not part of this build") as info:
        platforms.get_platform("cuda")
    assert "\n" not in str(info.value)


def test_current_platform(monkeypatch):
    monkeypatch.setattr(registry, "_current", None)
    monkeypatch.setenv(registry.DEVICE_ENV, "cpu")
    assert isinstance(platforms.current_platform(), CpuPlatform)
    mine = CpuPlatform()
    assert platforms.set_current_platform(mine) is mine
    assert platforms.current_platform() is mine
    with pytest.raises(PlatformUnavailable):
        platforms.set_current_platform("nosuchthing")


def test_import_is_light_and_disables_backend_autoload():
    code = ("import os, sys; import paged, paged.platforms; "
            "print(os.environ['TORCH_DEVICE_BACKEND_AUTOLOAD'], "
            "[m for m in ('torch', 'torch_npu', 'torch.cuda') if m in sys.modules])")
    env = {k: v for k, v in __import__("os").environ.items() if k != "TORCH_DEVICE_BACKEND_AUTOLOAD"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert out.stdout.split() == ["0", "[]"]
    env["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "1"  # a user's explicit choice wins
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert out.stdout.split()[0] == "1"
