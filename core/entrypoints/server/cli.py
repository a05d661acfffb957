"""`paged --device X serve`: load the model, warm up, serve the OpenAI API.

The CLI dispatcher (core/entrypoints/cli.py) calls add_arguments(parser) for the
subcommand's options and run(args) -> exit code; args.device is the
global --device, args.log_level the global --log-level (logging is set up).
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import gc
import os
import re
import socket
import sys
import threading

from paged.core.entrypoints.cli import fail

DEFAULT_MAX_WAITING = 1024


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from paged.core.engine.config import add_engine_args

    add_engine_args(parser)
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, loopback only)")
    g.add_argument("--port", type=int, default=8000, help="TCP port (default: 8000)")
    g.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/*, /tokenize, /detokenize "
                        "(default: $PAGED_API_KEY, else no key)")
    g.add_argument("--served-model-name", default=None,
                   help="model name clients must send (default: the model's file or folder name)")
    g.add_argument("--max-waiting-requests", type=int, default=DEFAULT_MAX_WAITING,
                   help="requests waiting for their first token beyond which new ones get 503 "
                        f"(default: {DEFAULT_MAX_WAITING})")
    g.add_argument("--max-body-size", type=int, default=8 * 2**20,
                   help="largest request body in bytes, else 413 (default: 8 MiB)")
    g.add_argument("--shutdown-timeout", type=float, default=10.0,
                   help="on SIGTERM/SIGINT, seconds to let in-flight requests finish before aborting them "
                        "(default: 10)")


def _check_args(args) -> str | None:
    if args.api_key is not None and not args.api_key.strip():
        return (f"--api-key: expected a non-empty key, got {args.api_key!r} "
                "(leave the option out to serve without one)")
    if not 0 < args.port < 65536:
        return f"--port must be in 1..65535, got {args.port}"
    if args.max_waiting_requests < 1:
        return f"--max-waiting-requests must be >= 1, got {args.max_waiting_requests}"
    if args.max_body_size < 1024:
        return f"--max-body-size must be >= 1024 bytes, got {args.max_body_size}"
    if args.shutdown_timeout < 0:
        return f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout}"
    return None


def _listen(host: str, port: int) -> socket.socket:
    """The server's socket, bound as uvicorn would bind it (IPv6 when the host
    has a colon, SO_REUSEADDR) but before the model loads: uvicorn reports a
    port in use or a bad host with pages of chained tracebacks, and only
    after the load."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def _listen_error(host: str, port: int, exc: OSError) -> str:
    if isinstance(exc, socket.gaierror):
        return (f"--host: expected a name or address that resolves, got {host!r} ({exc.strerror}); "
                "use e.g. 127.0.0.1 or 0.0.0.0")
    reasons = {errno.EADDRINUSE: "the port is in use: choose another --port or stop the process using it",
               errno.EADDRNOTAVAIL: "the address is not one of this machine's: check --host",
               errno.EACCES: "permission denied: ports below 1024 need privileges, choose another --port"}
    return f"cannot listen on {host}:{port}: {reasons.get(exc.errno, exc.strerror or exc)}"


def _uvicorn_log_level(level: str) -> str:
    # uvicorn's info lines (started, waiting for start-up, running on) repeat
    # paged's own "serving on" line
    return "warning" if level == "info" else level


def _served_name(args, engine) -> str:
    if args.served_model_name:
        return args.served_model_name
    from paged.core.models.hub import RepoSpec

    if args.model and not os.path.exists(args.model) and RepoSpec.parse(args.model):
        return args.model  # a Hub name is served as given, as vLLM does (org/name, org/name:QUANT)
    path = engine.model_path
    if path:
        base = os.path.basename(os.path.normpath(path))
        base = base[:-5] if base.endswith(".gguf") else base
        # SmolLM2-135M-Instruct.Q4_1 -> SmolLM2-135M-Instruct: clients name the model, not its quantisation
        return re.sub(r"[.-](?:[QqIi]Q?\d\w*|[Ff]16|[Ff]32|[Bb][Ff]16)$", "", base) or base
    return "default"


def _graceful_server_cls():
    import uvicorn

    class GracefulServer(uvicorn.Server):
        """On SIGTERM/SIGINT: stop taking requests at once (503), let those in
        flight run for `grace` seconds, then abort them so their clients get a
        proper end (an error chunk and [DONE] for streams) before we exit."""

        def __init__(self, config, aengine, grace: float):
            super().__init__(config)
            self.aengine, self.grace = aengine, grace
            self._deadline: threading.Timer | None = None

        def handle_exit(self, sig, frame) -> None:
            if self._deadline is None:
                self.aengine.stop_accepting()
                self._deadline = threading.Timer(self.grace, self.aengine.abort_in_flight)
                self._deadline.daemon = True
                self._deadline.start()
            super().handle_exit(sig, frame)
            # uvicorn re-raises captured signals after shutting down, which would
            # end the process with -SIGTERM; a graceful shutdown exits 0 instead
            self._captured_signals.clear()

        async def serve(self, sockets=None) -> None:
            try:
                await super().serve(sockets)
            finally:
                if self._deadline is not None:  # every stream ended before it
                    self._deadline.cancel()
                    self._deadline.join(1.0)

    return GracefulServer


def run(args: argparse.Namespace) -> int:
    error = _check_args(args)
    if error:
        return fail(error)
    try:
        sock = _listen(args.host, args.port)
    except OSError as exc:
        return fail(_listen_error(args.host, args.port, exc))
    with sock:
        return _serve(args, sock)


def _serve(args: argparse.Namespace, sock: socket.socket) -> int:
    import uvicorn

    from paged.core.entrypoints.async_engine import AsyncEngine
    from paged.core.engine.engine import Engine
    from paged.core.engine.config import engine_config_from_args
    from paged.core.entrypoints.server.app import ServerConfig, create_app
    from paged.core.entrypoints.server.metrics import ServerMetrics

    GracefulServer = _graceful_server_cls()

    try:
        config = engine_config_from_args(args)
        engine = Engine(config)  # loads the model, sizes the KV cache, warms up
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        return fail(exc)
    engine.group.stop_process_on_failure()  # tensor parallel: a rank that dies ends the server

    name = _served_name(args, engine)
    server_config = ServerConfig(
        model_name=name,
        max_model_len=engine.max_model_len,
        vocab_size=engine.model_config.vocab_size,
        api_key=args.api_key or os.environ.get("PAGED_API_KEY") or None,
        max_body_bytes=args.max_body_size,
        model_root=engine.model_path,
    )
    metrics = ServerMetrics(name)
    aengine = AsyncEngine(engine, max_waiting=args.max_waiting_requests, observer=metrics)
    # The engine thread takes the GIL back after every kernel of a step; with
    # the default 5 ms switch interval a busy event loop could keep it waiting.
    # 0.2 ms cut 1-stream time per output token by ~1 ms (of ~15) here.
    sys.setswitchinterval(2e-4)
    # What start-up built (model, tokenizer, metadata) lives as long as the
    # server: out of the collector's generations, full collections in the
    # step loop stop walking it (~3% of the engine thread at 16 streams).
    gc.collect()
    gc.freeze()
    app = create_app(aengine, engine.tokenizer, server_config, metrics)
    uv_config = uvicorn.Config(
        app, host=args.host, port=args.port, log_level=_uvicorn_log_level(args.log_level),
        # a backstop only: GracefulServer ends the streams itself at the deadline
        timeout_graceful_shutdown=args.shutdown_timeout + 2.0, access_log=False,
    )
    server = GracefulServer(uv_config, aengine, args.shutdown_timeout)
    device = getattr(args, "device", None) or config.device

    async def serve() -> None:
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started and not task.done():
            await asyncio.sleep(0.05)
        if server.started:
            print(f"paged: serving {name} on http://{args.host}:{args.port} (device {device})", flush=True)
        await task

    try:
        asyncio.run(serve())
    finally:
        started = server.started
        # Free the engine (KV block pool, layer stack) while its extension
        # module is loaded: left to interpreter teardown, reference cycles kept
        # it alive and nanobind printed "leaked instances" on every shutdown.
        engine.close()  # tensor parallel: the other ranks stop
        del app, server, aengine, engine, uv_config, serve
        gc.unfreeze()  # the engine's cycles are collectable again
        gc.collect()
    if not started:
        return fail(f"could not start serving on {args.host}:{args.port} (see the log above)")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry (`python -m paged.core.entrypoints.server.cli --device cpu ...`),
    through the dispatcher so options, logging and errors are the same."""
    from paged.core.entrypoints.cli import main as paged_main

    return paged_main(["serve", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
