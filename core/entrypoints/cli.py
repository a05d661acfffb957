"""The ``paged`` command: ``paged [--device auto|cpu|cuda|npu|<plugin>] <command> ...``.

Commands live in their own modules, listed in COMMANDS and imported only
when run, so ``paged env`` stays fast and a command whose module is missing
from this build says so instead of breaking the others. A command module
provides ``add_arguments(parser)`` and ``run(args) -> int`` (a Command entry
may name other functions, which is how one module serves both generate and
chat). ``args.device`` is the resolved platform name; the platform is also
set as current_platform() before ``run`` is called.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import platform as pyplatform
import sys
from dataclasses import dataclass

from paged.core.engine.distributed.layout import RankFailed, resolve_size, torchrun_env
from paged.platforms import PlatformUnavailable, get_platform, set_current_platform


@dataclass(frozen=True)
class Command:
    module: str
    help: str
    add_arguments: str = "add_arguments"
    run: str = "run"


COMMANDS: dict[str, Command] = {
    "env": Command("paged.core.entrypoints.cli", "show the platform, topology, thread binding and build",
                   "add_env_arguments", "run_env"),
    "serve": Command("paged.core.entrypoints.server.cli", "serve the OpenAI-compatible HTTP API"),
    "generate": Command("paged.core.entrypoints.generate", "generate completions for prompts"),
    "chat": Command("paged.core.entrypoints.generate", "interactive chat", "add_chat_arguments", "run_chat"),
    "bench": Command("paged.core.bench.cli", "measure throughput and latency"),
    "conformance": Command("paged.core.conformance.cli", "check a platform against the reference backend"),
}

#: commands that run an engine: under torchrun, ranks > 0 follow rank 0's instead
FOLLOWERS = ("serve", "generate", "chat")

#: errors a user can fix; printed as one line with exit status 2
USER_ERRORS = (ValueError, PlatformUnavailable, FileNotFoundError, RankFailed)
DEVICE_HELP = "platform: auto (cuda > npu > cpu), cpu, cuda, npu or a plugin's name"
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
LOG_HELP = "level of paged's own log lines on stderr (other libraries: warning and up)"


class CommandUnavailable(Exception):
    """The command's module is not part of this build."""


def fail(message: object) -> int:
    """Print a user error as one line on stderr; returns the exit status, 2."""
    print(f"paged: error: {' '.join(str(message).split())}", file=sys.stderr)
    return 2


def configure_logging(level: str) -> None:
    """The one logging set-up of every command: paged's loggers ("paged",
    "paged.engine", ...) at ``level``, every other library at warning (or
    ``level`` when higher), on stderr."""
    numeric = getattr(logging, level.upper())
    logging.basicConfig(level=max(numeric, logging.WARNING), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("paged").setLevel(numeric)


def _load(name: str):
    """(add_arguments, run) of a command; CommandUnavailable when missing."""
    cmd = COMMANDS[name]
    try:
        module = importlib.import_module(cmd.module)
    except ModuleNotFoundError as e:
        if e.name and cmd.module.startswith(e.name):  # the command's own module is absent
            raise CommandUnavailable(f"command {name!r} is not available in this build ({cmd.module} is missing)")
        raise CommandUnavailable(f"command {name!r} needs the Python package {e.name!r}: pip install {e.name}")
    try:
        return getattr(module, cmd.add_arguments), getattr(module, cmd.run)
    except AttributeError as e:
        raise CommandUnavailable(f"command {name!r} is not available in this build ({e})") from None


class _Parser(argparse.ArgumentParser):
    """argparse with its errors on one line: what is wrong, then where help is
    (argparse prints the whole usage first, 20 lines for serve)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def _top_parser() -> argparse.ArgumentParser:
    from paged import __version__

    parser = _Parser(
        prog="paged", description="Paged-attention LLM serving on CPU, CUDA and Ascend NPU.",
        epilog="Run 'paged <command> --help' for a command's options.")
    parser.add_argument("--device", default=None, help=DEVICE_HELP + " (default: $PAGED_DEVICE, else auto)")
    parser.add_argument("--log-level", choices=LOG_LEVELS, default="info", help=LOG_HELP + " (default: info)")
    parser.add_argument("--version", action="version", version=f"paged {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="<command>", required=True)
    for name, cmd in COMMANDS.items():
        # Only names and help here; each command's options are added once it is chosen.
        commands.add_parser(name, help=cmd.help, add_help=False)
    return parser


def _split_argv(argv: list[str]) -> tuple[list[str], str | None, list[str]]:
    """Global options, the command name, and the command's own arguments."""
    for i, arg in enumerate(argv):
        if arg in COMMANDS and (i == 0 or argv[i - 1] != "--device"):
            return argv[:i], arg, argv[i + 1:]
    return argv, None, []


def _add_global_options(parser: argparse.ArgumentParser) -> None:
    """--device and --log-level are also accepted after the command name."""
    for flag, extra in (("--device", {"help": DEVICE_HELP}),
                        ("--log-level", {"choices": LOG_LEVELS, "help": LOG_HELP})):
        try:
            parser.add_argument(flag, default=argparse.SUPPRESS, **extra)
        except argparse.ArgumentError:
            pass  # the command defines its own


def main(argv: list[str] | None = None) -> int:
    import os

    argv = list(sys.argv[1:] if argv is None else argv)
    global_argv, name, rest = _split_argv(argv)
    top = _top_parser()
    top_args = top.parse_args(global_argv + ([name] if name else []))  # exits on --help, bad option, no command

    try:
        add_arguments, run = _load(name)
    except CommandUnavailable as e:
        return fail(e)
    parser = _Parser(prog=f"paged {name}", description=COMMANDS[name].help)
    add_arguments(parser)
    _add_global_options(parser)
    args = parser.parse_args(rest)
    args.command = name
    device = getattr(args, "device", None) or top_args.device or os.environ.get("PAGED_DEVICE") or "auto"
    args.log_level = getattr(args, "log_level", top_args.log_level)
    configure_logging(args.log_level)

    try:
        platform = get_platform(device)
        set_current_platform(platform)
        args.device = platform.name
        args.platform = platform
        if name in FOLLOWERS and (torchrun_env() or (0, 1))[0] > 0:
            # imported here: it loads torch and the engine, which 'paged env' and --help do not need
            from paged.core.engine.distributed.rank import follow_torchrun

            return follow_torchrun(platform.dist_backend)  # rank 0 runs the command (docs/distributed.md)
        return int(run(args) or 0)
    except USER_ERRORS as e:
        return fail(e)
    except KeyboardInterrupt:
        return 130


# ---- paged env -------------------------------------------------------------

def add_env_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--cpu-threads-bind", default="auto",
                        help="auto | none | <cpu list>[|<cpu list>...] (CPU platform; default: auto)")
    parser.add_argument("-tp", "--tensor-parallel-size", default="1",
                        help="show the layout of N tensor parallel ranks, or auto (default: 1)")


def compiled_modules() -> dict[str, str]:
    """Each compiled module -> "ok (path)", or where it was found and why it
    does not import, or that this build does not have it."""
    import importlib.util

    found = {}
    for module in ("paged._C_cpu", "paged._C_cuda", "paged._C_ascend"):
        spec = importlib.util.find_spec(module)
        if spec is None:
            found[module] = "not built (its toolchain was not found when paged was installed)"
            continue
        try:
            importlib.import_module(module)
            found[module] = f"ok ({spec.origin})"
        except Exception as e:  # ImportError, or a shared library missing underneath
            found[module] = f"built ({spec.origin}) but not importable: {type(e).__name__}: {' '.join(str(e).split())}"
    return found


def env_report(platform, threads_bind: str) -> dict:
    from paged import __version__

    platform.init(threads_bind=threads_bind)  # platforms ignore options they do not know
    try:
        import torch

        torch_version = torch.__version__
    except ImportError as e:
        torch_version = f"not importable: {e}"
    return {
        "paged": __version__,
        "python": pyplatform.python_version(),
        "torch": torch_version,
        "compiled_modules": compiled_modules(),
        **platform.env_report(),
    }


def parallel_layout(platform, threads_bind: str, tensor_parallel_size) -> dict:
    """The tensor parallel layout ``paged ... -tp N`` would use here."""
    from paged.core.engine.config import parse_tensor_parallel_size

    env = torchrun_env()
    size = env[1] if env else resolve_size(parse_tensor_parallel_size(tensor_parallel_size), platform)
    return {"tensor_parallel_size": size, "collective_backend": platform.dist_backend,
            "launcher": "torchrun" if env else ("spawn" if size > 1 else "single process"),
            "ranks": [platform.rank_layout(r, size, threads_bind=threads_bind) for r in range(size)]}


def run_env(args: argparse.Namespace) -> int:
    report = env_report(args.platform, args.cpu_threads_bind)
    report["parallel"] = parallel_layout(args.platform, args.cpu_threads_bind, args.tensor_parallel_size)
    print(json.dumps(report, indent=2, default=str) if args.json else format_env(report))
    return 0


def format_env(report: dict) -> str:
    from paged.platforms.sizes import format_size

    def size(value):
        return format_size(value) if isinstance(value, int) else "unknown"

    lines = [f"platform        {report['platform']}",
             f"versions        paged {report['paged']}, torch {report['torch']}, python {report['python']}"]
    lines += [f"  {name:<16}{status}" for name, status in report["compiled_modules"].items()]
    topo = report.get("topology")
    if topo:
        lines.append(f"cpus            online {topo['online_cpus']}, allowed {topo['allowed_cpus']}, "
                     f"usable {topo['usable_cpus']}, {topo['physical_cores']} physical cores"
                     + ("" if topo["numa_info"] else " (no NUMA info in sysfs: one node)"))
        for node in topo["nodes"]:
            smt = ", SMT siblings " + " ".join(node["smt_siblings"]) if node["smt_siblings"] else ""
            lines.append(f"  node {node['id']:<9}cpus {node['cpus'] or '-'}, {node['physical_cores']} cores{smt}, "
                         f"memory {size(node['mem_free_bytes'])} free of {size(node['mem_total_bytes'])}")
    binding = report.get("binding")
    if binding:
        lines.append(f"binding         --cpu-threads-bind {binding['spec']}: "
                     + (f"{binding['threads']} threads on cpus {binding['cpus']}" if binding["threads"] else "no pinning")
                     + (f", memory node {binding['node']} ({binding['memory_method']})" if binding["node"] is not None else ""))
    for t in report.get("threads") or []:
        lines.append(f"  thread {t['thread']:<7}on cpu {t['cpu']}, affinity {','.join(map(str, t['affinity']))}")
    if report.get("memory_policy"):
        policy = report["memory_policy"]
        lines.append(f"memory policy   {policy['mode']} {','.join(map(str, policy['nodes']))}".rstrip()
                     + f" (libnuma {'found' if report.get('libnuma') else 'missing: raw syscall'})")
    if report.get("cpu_features"):
        feats = report["cpu_features"]
        lines.append("cpu features    " + " ".join(f"{k}{'+' if v else '-'}" for k, v in feats.items()))
        if report.get("cpu_features_hidden"):
            lines.append(f"  hidden        {' '.join(report['cpu_features_hidden'])} (PAGED_CPU_HIDE)")
    if report.get("kernel_builds"):
        lines.append("kernel builds   " + ", ".join(f"{k} {v}" for k, v in report["kernel_builds"].items()))
    if report.get("linear_activations"):
        lines.append(f"linear          --linear-activations auto = {report['linear_activations']}")
    if report.get("dtypes"):
        lines.append(f"dtypes          {', '.join(report['dtypes'])} (default {report['dtypes'][0]})")
    if report.get("memory"):
        lines.append(f"memory          {size(report['memory']['available_bytes'])} available "
                     f"of {size(report['memory']['total_bytes'])}")
    if "kv_cache_budget_bytes" in report:
        lines.append(f"kv cache budget {size(report['kv_cache_budget_bytes'])}")
    par = report.get("parallel")
    if par:
        lines.append(f"parallel        -tp {par['tensor_parallel_size']} ({par['launcher']}), collectives "
                     f"{par['collective_backend']}")
        for r in par["ranks"]:
            where = ", ".join(f"{k} {v}" for k, v in r.items() if k != "rank" and v is not None)
            lines.append(f"  rank {r['rank']:<9}{where}")
    known = {"platform", "available", "reason", "paged", "python", "torch", "compiled_modules", "topology", "binding", "threads",
             "parallel",
             "memory_policy", "libnuma", "cpu_features", "cpu_features_hidden", "kernel_builds", "linear_activations",
             "dtypes", "memory",
             "kv_cache_budget_bytes"}
    lines += [f"{k:<16}{v}" for k, v in report.items() if k not in known]  # other platforms' extras
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
