"""`paged --device X serve`: load the model, warm up, serve the OpenAI API.

The CLI dispatcher (core/cli.py) calls add_arguments(parser) for the
subcommand's options and run(args) -> exit code; args.device is the
global --device.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import re
import sys
import threading

DEFAULT_MAX_WAITING = 1024


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from paged.core.engine_config import add_engine_args

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
    g.add_argument("--log-level", default="warning", help="uvicorn log level (default: warning)")


def _fail(message: str) -> int:
    print(f"paged serve: {message}", file=sys.stderr)
    return 2


def _check_args(args) -> str | None:
    if not 0 < args.port < 65536:
        return f"--port must be in 1..65535, got {args.port}"
    if args.max_waiting_requests < 1:
        return f"--max-waiting-requests must be >= 1, got {args.max_waiting_requests}"
    if args.max_body_size < 1024:
        return f"--max-body-size must be >= 1024 bytes, got {args.max_body_size}"
    if args.shutdown_timeout < 0:
        return f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout}"
    return None


def _served_name(args, engine) -> str:
    if args.served_model_name:
        return args.served_model_name
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
        return _fail(error)
    import uvicorn

    from paged.core.async_engine import AsyncEngine
    from paged.core.engine import Engine
    from paged.core.engine_config import engine_config_from_args
    from paged.core.server.app import ServerConfig, create_app
    from paged.core.server.metrics import ServerMetrics

    GracefulServer = _graceful_server_cls()

    try:
        config = engine_config_from_args(args)
        engine = Engine(config)  # loads the model, sizes the KV cache, warms up
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        return _fail(str(exc))

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
    app = create_app(aengine, engine.tokenizer, server_config, metrics)
    uv_config = uvicorn.Config(
        app, host=args.host, port=args.port, log_level=args.log_level,
        # a backstop only: GracefulServer ends the streams itself at the deadline
        timeout_graceful_shutdown=args.shutdown_timeout + 2.0, access_log=False,
    )
    server = GracefulServer(uv_config, aengine, args.shutdown_timeout)
    device = getattr(args, "device", None) or config.device

    async def serve() -> None:
        task = asyncio.create_task(server.serve())
        while not server.started and not task.done():
            await asyncio.sleep(0.05)
        if server.started:
            print(f"paged: serving {name} on http://{args.host}:{args.port} (device {device})", flush=True)
        await task

    try:
        asyncio.run(serve())
    except OSError as exc:  # port in use, bad host
        return _fail(f"cannot listen on {args.host}:{args.port}: {exc}")
    finally:
        started = server.started
        # Free the engine (KV block pool, layer stack) while its extension
        # module is loaded: left to interpreter teardown, reference cycles kept
        # it alive and nanobind printed "leaked instances" on every shutdown.
        del app, server, aengine, engine, uv_config, serve
        gc.collect()
    if not started:
        return _fail(f"could not start serving on {args.host}:{args.port} (see the log above)")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry (`python -m paged.core.server.cli --device cpu ...`)."""
    parser = argparse.ArgumentParser(prog="paged serve")
    parser.add_argument("--device", default="auto")
    add_arguments(parser)
    logging.basicConfig(level=logging.WARNING)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
