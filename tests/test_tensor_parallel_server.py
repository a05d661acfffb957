"""Tensor parallelism through the command line, as real processes: a `paged
serve -tp 2` server (streamed completions, a client disconnect storm that
must free every block, a killed rank that must stop the server with one
error naming it) and the torchrun path on one machine (`torchrun --nnodes 1
--nproc-per-node 2 -m paged.core.entrypoints.cli generate`), whose greedy text must equal
the spawned -tp 2 and the -tp 1 runs'.

Slow (each starts two model-loading processes): .ci/run runs it after the
README command with PAGED_TP_SLOW=1.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from test_server import PROMPTS, ServerProcess, _stream_text, open_and_drop, wait_idle

pytestmark = pytest.mark.skipif(not os.environ.get("PAGED_TP_SLOW"),
                                reason="slow stage: .ci/run runs it with PAGED_TP_SLOW=1")

RANK_EXIT_TIMEOUT_S = 15


def rank_pids(parent: int) -> list[int]:
    """Processes spawned by ``parent`` that run a paged rank (not
    multiprocessing's resource tracker)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        if int(fields[1]) == parent and b"spawn_main" in cmdline and b"resource_tracker" not in cmdline:
            pids.append(int(stat.parent.name))
    return pids


def test_tp2_server_streams_frees_blocks_and_stops_when_a_rank_dies():
    server = ServerProcess("-tp", "2", "--cpu-threads-bind", "0|1")
    try:
        async def main():
            async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
                streamed = await _stream_text(c, server.model, PROMPTS[0], 12)
                whole = (await c.post("/v1/completions", json={"model": server.model, "prompt": PROMPTS[0],
                                                               "max_tokens": 12, "temperature": 0})).json()
                await asyncio.gather(*(open_and_drop(c, server.model, PROMPTS[i % len(PROMPTS)] * 4, 500)
                                       for i in range(12)))
            return streamed, whole["choices"][0]["text"]

        streamed, whole = asyncio.run(main())
        assert streamed == whole and streamed  # the stream's deltas add up to the completion
        m = wait_idle(server.url)
        assert m["paged:kv_cache_blocks_used"] == 0 and m["paged:num_requests_running"] == 0

        ranks = rank_pids(server.proc.pid)
        assert len(ranks) == 1, ranks
        os.kill(ranks[0], signal.SIGKILL)
        server.proc.wait(RANK_EXIT_TIMEOUT_S)
        assert server.proc.returncode == 1
        assert "paged: error: tensor parallel rank 1 was killed by signal 9; the server stops" in server.log_tail()
    finally:
        server.stop()


def generate(*launcher: str, tp: str = "1", env: dict | None = None) -> str:
    cmd = [*launcher, "--device", "cpu", "generate", "--dtype", "float32", "--temperature", "0",
           "--max-tokens", "12", "--max-model-len", "512", "-tp", tp, "--cpu-threads-bind", "0|1",
           "The capital of France is"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})})
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_torchrun_on_one_machine_equals_spawned_ranks():
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    if torchrun is None:
        pytest.skip("torchrun is not installed next to this Python")
    paged = [sys.executable, "-m", "paged.core.entrypoints.cli"]
    t0 = time.monotonic()
    launched = generate(torchrun, "--nnodes", "1", "--nproc-per-node", "2", "--standalone",
                        "-m", "paged.core.entrypoints.cli", tp="2")
    spawned = generate(*paged, tp="2")
    assert launched == spawned and launched.strip(), (launched, spawned)
    assert time.monotonic() - t0 < 240
