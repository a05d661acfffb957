"""The Platform contract (platforms/base.py): detection, memory, dtypes,
distributed backend, attention backend class, block size, env report."""

from __future__ import annotations

import json

import torch

from paged.core.conformance.runner import Check, Context, Skip

KNOWN_DIST_BACKENDS = {"gloo", "nccl", "hccl", "mpi", "ucc", "xccl", "cncl", "mccl"}


def _detection(ctx: Context):
    p = ctx.platform
    a = p.is_available()
    if not a.ok:
        assert a.reason.strip(), "is_available() said not ok without a reason"
        raise Skip(f"{p.name} not available here: {a.reason}")
    n = p.device_count()
    assert isinstance(n, int) and n >= 1, f"available but device_count() = {n!r}"
    assert p.name and isinstance(p.name, str), f"name must be a non-empty str, got {p.name!r}"
    dev = p.torch_device(0)
    assert isinstance(dev, torch.device) and dev.type == p.device_type, \
        f"torch_device(0) = {dev!r} does not match device_type {p.device_type!r}"


def _memory(ctx: Context):
    m = ctx.platform.memory_info()
    assert m.total_bytes > 0, f"total_bytes = {m.total_bytes}"
    assert 0 < m.available_bytes <= m.total_bytes, \
        f"available_bytes = {m.available_bytes} not in (0, total_bytes={m.total_bytes}]"
    budget = ctx.platform.kv_cache_budget_bytes(None)
    assert 0 < budget <= m.available_bytes, f"default KV budget {budget} not in (0, {m.available_bytes}]"
    try:
        ctx.platform.kv_cache_budget_bytes(m.available_bytes * 2 + 1)
    except ValueError:
        pass
    else:
        raise AssertionError("kv_cache_budget_bytes accepted more than the available memory")


def _dtypes(ctx: Context):
    p = ctx.platform
    dtypes = p.supported_dtypes()
    assert dtypes, "supported_dtypes() is empty"
    for dt in dtypes:
        assert isinstance(dt, torch.dtype) and dt.is_floating_point, f"{dt!r} is not a floating torch dtype"
        t = torch.ones(4, dtype=dt, device=p.torch_device(0)) * 2
        assert float(t.sum().cpu()) == 8.0, f"arithmetic in {dt} on {p.device_type} gave {float(t.sum())}"
    assert p.default_dtype() in dtypes, f"default_dtype {p.default_dtype()} not in {dtypes}"


def _dist_backend(ctx: Context):
    name = ctx.platform.dist_backend
    assert isinstance(name, str) and name == name.lower() and name, f"dist_backend {name!r}"
    if name in KNOWN_DIST_BACKENDS:
        return
    import torch.distributed as dist

    if not (dist.is_available() and name in dist.Backend.backend_list):
        raise AssertionError(f"dist_backend {name!r} is neither a known collective backend "
                             f"({', '.join(sorted(KNOWN_DIST_BACKENDS))}) nor registered with torch.distributed")


def _attention_backend(ctx: Context):
    from paged.backends.base import AttentionBackend

    p = ctx.platform
    cls = ctx.worker.attention_backend_cls()
    assert isinstance(cls, type) and issubclass(cls, AttentionBackend), \
        f"the worker's attention_backend_cls() returned {cls!r}, not an AttentionBackend subclass"
    bs = p.default_block_size
    assert isinstance(bs, int) and bs > 0, f"default_block_size {bs!r}"
    be = cls(8, 2, 64, bs, p.default_dtype(), p.torch_device(0))
    shape = be.kv_cache_shape(3)
    assert all(isinstance(d, int) for d in shape), f"kv_cache_shape(3) = {shape!r}"
    elems = 1
    for d in shape:
        elems *= d
    assert elems == 3 * bs * 2 * 64, f"kv_cache_shape(3) = {shape} holds {elems} elements, expected 3*{bs}*2*64"
    ((k, v),) = be.allocate_kv_cache(1, 3)
    assert tuple(k.shape) == shape and k.dtype == p.default_dtype() and k.device.type == p.device_type, \
        f"allocate_kv_cache gave {tuple(k.shape)} {k.dtype} on {k.device}"
    elem = torch.empty((), dtype=p.default_dtype()).element_size()
    assert be.bytes_per_block(1) == 2 * elems // 3 * elem, f"bytes_per_block(1) = {be.bytes_per_block(1)}"


def _capabilities(ctx: Context):
    """The declaration is coherent (its dtypes are the supported ones, it
    accepts the default block size) and binding: the engine refuses, at
    start and before loading a model, a block size it does not accept."""
    from paged.core.engine.engine import Engine, EngineConfig

    p, caps = ctx.platform, ctx.caps
    assert list(caps.dtypes) == list(p.supported_dtypes()), \
        f"capabilities().dtypes {caps.dtypes} differ from supported_dtypes() {p.supported_dtypes()}"
    assert caps.accepts_block_size(p.default_block_size), \
        f"default_block_size {p.default_block_size} is outside the declared block sizes"
    refused = _refused_block_size(caps)
    if refused is None:
        return None  # every block size is accepted: nothing to refuse
    try:  # model path that does not exist: only the start-up check may stop it first
        Engine(EngineConfig(model="/nonexistent/conformance-model.gguf", device=p.name, block_size=refused,
                            warm_up=False))
    except ValueError as e:
        assert "--block-size" in str(e) and str(refused) in str(e), f"refused with an unclear message: {e}"
        return None
    except FileNotFoundError:
        pass
    raise AssertionError(f"the engine went on to load a model with --block-size {refused}, "
                         "which the platform does not declare")


def _refused_block_size(caps) -> int | None:
    if caps.block_size_multiple > 1:
        return caps.block_size_multiple + 1
    return caps.max_block_size + 1 if caps.max_block_size else None


def argmax_cases(seed: int = 0) -> list[torch.Tensor]:
    """float32 logits (CPU) whose torch.argmax a Worker.argmax must return:
    random rows of several widths (a vocabulary, lane-count tails, width 1),
    ties (the first index wins), rows of -inf, +inf, and NaN (the first
    NaN wins, wherever the finite maximum lies)."""
    g = torch.Generator().manual_seed(seed)
    cases = [torch.randn(n, v, generator=g) for n, v in ((1, 49152), (16, 49152), (3, 37), (5, 1), (2, 100003))]
    t = torch.randn(8, 1000, generator=g)
    t[0, [5, 700]] = 50.0                  # tie: 5
    t[1] = 1.0                             # all equal: 0
    t[2] = float("-inf")                   # all -inf: 0
    t[3, [9, 990]] = float("inf")          # +inf tie: 9
    t[4, 800] = float("nan")               # NaN after the max
    t[4, 3] = 100.0
    t[5, [17, 400]] = float("nan")         # first NaN: 17
    t[6, 999] = 60.0                       # the last element (a tail lane)
    t[7, :] = float("nan")
    cases.append(t)
    return cases


def _argmax(ctx: Context):
    """Worker.argmax, the sampler's greedy step, is torch.argmax's answer."""
    p = ctx.platform
    for logits in argmax_cases():
        got = ctx.worker.argmax(logits.to(p.torch_device(0)))
        want = logits.argmax(dim=-1)
        assert got.dtype == torch.int64 and tuple(got.shape) == (logits.shape[0],), \
            f"argmax of {tuple(logits.shape)} gave {got.dtype} {tuple(got.shape)}"
        assert torch.equal(got.cpu(), want), \
            f"argmax of {tuple(logits.shape)}: rows {torch.nonzero(got.cpu() != want).flatten().tolist()[:8]} differ"


def _env_report(ctx: Context):
    rep = ctx.platform.env_report()
    json.dumps(rep)  # must be JSON-serialisable
    assert rep.get("platform") == ctx.platform.name, f"env_report platform {rep.get('platform')!r}"


def checks(ctx: Context) -> list[Check]:
    return [Check("platform.detection", _detection), Check("platform.memory", _memory),
            Check("platform.dtypes", _dtypes), Check("platform.dist_backend", _dist_backend),
            Check("worker.attention_backend", _attention_backend), Check("platform.capabilities", _capabilities),
            Check("worker.argmax", _argmax), Check("platform.env_report", _env_report)]
