"""`paged serve` start-up errors as one line (exit 2) before any model loads,
and the one logging set-up every command shares (--log-level), run as real
subprocesses."""

from __future__ import annotations

import re
import socket

import pytest
from test_cli_env import assert_one_line_error, paged
from test_server import shared_server

ENGINE_INFO = re.compile(r"^\S+ INFO paged\.engine: ", re.MULTILINE)


@pytest.fixture
def busy_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_port_in_use(busy_port):
    result = paged("--device", "cpu", "serve", "--port", str(busy_port))
    assert_one_line_error(result, f"cannot listen on 127.0.0.1:{busy_port}: the port is in use",
                          "choose another --port")


def test_unresolvable_host():
    # .invalid never resolves (RFC 6761)
    result = paged("--device", "cpu", "serve", "--host", "no-such-host.invalid")
    assert_one_line_error(result, "--host: expected a name or address that resolves, got 'no-such-host.invalid'")


@pytest.mark.parametrize("key", ["", " "])
def test_empty_api_key_is_refused(key):
    # it used to start a server without authentication
    result = paged("--device", "cpu", "serve", "--api-key", key)
    assert_one_line_error(result, f"--api-key: expected a non-empty key, got {key!r}")


@pytest.mark.parametrize("args", [("serve", "--log-level", "bogus"), ("--log-level", "bogus", "generate", "hi")])
def test_bad_log_level(args):
    result = paged("--device", "cpu", *args)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "argument --log-level: invalid choice: 'bogus'" in lines[0], result.stderr


def test_four_byte_model_file(tmp_path):
    model = tmp_path / "four.gguf"
    model.write_bytes(b"GGUF")
    result = paged("--device", "cpu", "generate", "--model", str(model), "hi")
    assert_one_line_error(result, "four.gguf: truncated GGUF file: 4 bytes")


# ---- logging: paged's INFO lines on stderr by default ----------------------

@pytest.mark.parametrize("command", [("generate", "Hello"), ("chat",)], ids=lambda c: c[0])
def test_engine_info_line_on_stderr(command):
    result = paged("--device", "cpu", *command, "--max-tokens", "2", "--max-model-len", "256", input="Hello\n")
    assert result.returncode == 0, result.stderr
    assert ENGINE_INFO.search(result.stderr), result.stderr


def test_log_level_warning_hides_info():
    result = paged("--device", "cpu", "generate", "Hello", "--max-tokens", "2", "--max-model-len", "256",
                   "--log-level", "warning")
    assert result.returncode == 0, result.stderr
    assert " INFO " not in result.stderr, result.stderr


def test_serve_logs_engine_info_line():
    server = shared_server()  # the one test_server.py starts, when run together
    assert ENGINE_INFO.search(server.log_tail(100_000)), server.log_tail()
