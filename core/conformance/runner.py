"""Runs conformance checks, one at a time, never letting one crash the run.

A check is a function ``fn(ctx) -> float | Measured | None`` (the max error
it saw, if it measures one). It passes by returning, skips by raising
Skip(reason naming the missing hardware or feature), and fails by raising
anything else: the exception text becomes the FAIL detail. A Measured is a
pass that reports what the platform does not guarantee (e.g. batch
invariance it does not declare): the value and what it is.

The platform's declaration (``Platform.capabilities()``) is read once into
the Context; checks build their cases from it and the report lists it.
"""

from __future__ import annotations

import inspect
import json
import platform as _host
import time
import traceback
from dataclasses import asdict, dataclass, field
from typing import Callable

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"


class Skip(Exception):
    """Raised by a check that cannot run here; the message says why."""


@dataclass
class Measured:
    """A passing check's measurement of something not declared guaranteed."""

    value: float
    note: str


@dataclass
class Context:
    platform: object  # paged.platforms.Platform
    quick: bool = False
    seed: int = 0
    cache: dict = field(default_factory=dict)  # shared by checks (e.g. a loaded engine)

    @property
    def caps(self):
        """The platform's Capabilities (platform.capabilities checks that it can be read)."""
        if "caps" not in self.cache:
            self.cache["caps"] = self.platform.capabilities()
        return self.cache["caps"]

    @property
    def pool_cls(self):
        """The block accounting checked: the one every platform shares
        (core/engine/kv_cache_manager.py shared_block_pool), unless a test
        puts another in ``cache["pool_cls"]``."""
        from paged.core.engine.kv_cache_manager import shared_block_pool

        return self.cache.get("pool_cls") or shared_block_pool()[0]

    @property
    def worker(self):
        """A Worker the platform makes (no device set-up, no model): what runs
        on the device (attention backend, argmax, packed linears)."""
        if "worker" not in self.cache:
            self.cache["worker"] = self.platform.worker_cls()(self.platform)
        return self.cache["worker"]


@dataclass
class Check:
    name: str
    fn: Callable[[Context], float | None]
    required: bool = True


@dataclass
class CheckResult:
    name: str
    status: str
    max_error: float | None = None
    seconds: float = 0.0
    detail: str = ""
    required: bool = True


@dataclass
class Report:
    platform: str
    quick: bool
    results: list[CheckResult] = field(default_factory=list)
    declaration: dict | None = None  # Capabilities.to_json() of the platform, when it could be read

    @property
    def passed(self) -> bool:
        """Every required check passed or was skipped, and something ran."""
        required = [r for r in self.results if r.required]
        return all(r.status != FAIL for r in required) and any(r.status == PASS for r in required)

    def counts(self) -> dict[str, int]:
        return {s: sum(r.status == s for r in self.results) for s in (PASS, FAIL, SKIP)}

    def to_json(self) -> dict:
        return {"platform": self.platform, "quick": self.quick, "passed": self.passed,
                "counts": self.counts(), "host": _host.node(), "declaration": self.declaration,
                "results": [asdict(r) for r in self.results]}

    def write_json(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_json(), f, indent=2)

    def table(self) -> str:
        rows = [("check", "status", "max error", "time", "detail")]
        for r in self.results:
            err = "" if r.max_error is None else f"{r.max_error:.3g}"
            rows.append((r.name + ("" if r.required else " (optional)"), r.status, err,
                         f"{r.seconds:.2f}s", r.detail))
        widths = [max(len(row[i]) for row in rows) for i in range(4)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(row[:4], widths)) + ("  " + row[4] if row[4] else "")
                 for row in rows]
        if self.declaration:
            d = self.declaration
            inv = "; ".join(f"{k}: {', '.join(v) or 'none'}" for k, v in d["batch_invariant"].items())
            lines.insert(0, f"declared: dtypes {', '.join(d['dtypes'])}; block sizes {d['block_sizes']}; "
                            f"head sizes {d['head_sizes']}; batch invariant paths {inv}")
        c = self.counts()
        verdict = "CONFORMS" if self.passed else "DOES NOT CONFORM"
        lines.append(f"{self.platform}: {verdict} ({c[PASS]} passed, {c[FAIL]} failed, {c[SKIP]} skipped)")
        return "\n".join(lines)


def _one_line(text: str, limit: int = 300) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def run_check(check: Check, ctx: Context) -> CheckResult:
    t0 = time.perf_counter()
    try:
        err = check.fn(ctx)
        status, detail = PASS, ""
        if isinstance(err, Measured):
            err, detail = err.value, _one_line(err.note)
    except Skip as e:
        err, status, detail = None, SKIP, _one_line(e)
    except BaseException as e:  # noqa: BLE001  a failing check must never stop the run
        if isinstance(e, KeyboardInterrupt):
            raise
        err, status = None, FAIL
        where = traceback.extract_tb(e.__traceback__)[-1] if e.__traceback__ else None
        at = f" [{where.filename.rsplit('/', 1)[-1]}:{where.lineno}]" if where else ""
        detail = _one_line(f"{type(e).__name__}: {e}{at}")
    return CheckResult(check.name, status, None if err is None else float(err),
                       time.perf_counter() - t0, detail, check.required)


def collect_checks(ctx: Context) -> list[Check]:
    from paged.core.conformance import e2e_checks, kv_cache_checks, platform_checks, pool_checks

    return [*platform_checks.checks(ctx), *pool_checks.checks(ctx), *kernel_checks(ctx), *kv_cache_checks.checks(ctx),
            *e2e_checks.checks(ctx)]


KERNEL_HEAD_SIZES = (64, 128)


def kernel_checks(ctx: Context) -> list[Check]:
    """One check per (function, dtype, head size) of core/conformance/kernel_checks.py,
    whose public ``check_*`` functions take (backend_cls, device, dtype) and
    optionally head_size / block_size / quick / seed."""
    try:
        from paged.core.conformance import kernel_checks as kc
    except ImportError as e:
        def missing(_ctx, e=e):
            raise Skip(f"kernel checks not available in this build ({e})")
        return [Check("kernels", missing)]
    fns = [(n, f) for n, f in vars(kc).items() if n.startswith("check_") and callable(f)
           and getattr(f, "__module__", "") == kc.__name__]
    if not fns:
        def empty(_ctx):
            raise Skip("core/conformance/kernel_checks.py defines no check_* functions yet")
        return [Check("kernels", empty)]
    p = ctx.platform
    try:
        dtypes, caps = list(p.supported_dtypes()), ctx.caps
    except Exception:  # reported by platform.dtypes / platform.capabilities; nothing to run with
        dtypes, caps = [], None
    head_sizes = sorted({caps.head_size_near(d) for d in KERNEL_HEAD_SIZES}) if caps else KERNEL_HEAD_SIZES
    out = []
    for name, fn in sorted(fns):
        params = inspect.signature(fn).parameters
        sizes = head_sizes if "head_size" in params else (None,)
        for dtype in dtypes:
            for head_size in sizes:
                label = f"kernels.{name[len('check_'):]}[{str(dtype).replace('torch.', '')}"
                label += f",D={head_size}]" if head_size else "]"
                out.append(Check(label, _kernel_runner(fn, params, dtype, head_size)))
    return out


def _kernel_runner(fn, params, dtype, head_size):
    def run(ctx: Context):
        p = ctx.platform
        extra = {"head_size": head_size, "block_size": p.default_block_size, "quick": ctx.quick, "seed": ctx.seed,
                 "caps": ctx.caps}
        kwargs = {k: v for k, v in extra.items() if k in params and v is not None}
        result = fn(ctx.worker.attention_backend_cls(), p.torch_device(0), dtype, **kwargs)
        if isinstance(result, dict) and "max_error" in result:
            result = result.get("max_error")
        return result
    return run


def run_suite(platform, quick: bool = False, seed: int = 0, only: str | None = None,
              cache: dict | None = None) -> Report:
    """Run every check (or those whose name contains ``only``) for ``platform``.
    ``cache``: the dict the checks share (e.g. the engines they load), for a
    caller that reuses them afterwards."""
    ctx = Context(platform=platform, quick=quick, seed=seed, cache={} if cache is None else cache)
    report = Report(platform=getattr(platform, "name", str(platform)), quick=quick)
    available = platform.is_available()
    if available.ok:
        try:
            report.declaration = ctx.caps.to_json()
        except Exception:  # noqa: BLE001  platform.capabilities reports it as a FAIL
            pass
    checks = collect_checks(ctx)
    if only:
        checks = [c for c in checks if only in c.name]
    for check in checks:
        if not available.ok and check.name != "platform.detection":
            report.results.append(CheckResult(check.name, SKIP, detail=f"platform unavailable: {available.reason}",
                                              required=check.required))
            continue
        report.results.append(run_check(check, ctx))
    return report
