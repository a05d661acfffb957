"""`paged bench serve` against a real server: every request completes, the
token counts it reports agree with the server's own counters (/metrics),
and text prompts tokenize to exactly --input-len tokens (/tokenize)."""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
from types import SimpleNamespace

import httpx
import pytest

from test_server import metrics, shared_server

from paged.core.bench import serve as bench_serve


@pytest.fixture(scope="module")
def server():
    return shared_server()


def test_bench_serve_counts_match_server(server, tmp_path):
    before = metrics(server.url)
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-c", "import sys; from paged.core.entrypoints.cli import main; sys.exit(main())", "bench", "serve",
           "--base-url", server.url, "--num-prompts", "4", "--input-len", "24", "--output-len", "6",
           "--max-concurrency", "1,4", "--ignore-eos", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    report = json.loads(out.read_text())
    assert [L["max_concurrency"] for L in report["levels"]] == [1, 4]
    for level in report["levels"]:
        assert level["completed"] == 4 and level["failed"] == 0
        assert level["total_output_tokens"] == 4 * 6  # EOS ignored: exactly --output-len each
        assert level["ttft_ms"]["p50"] <= level["e2e_ms"]["p50"]
    after = metrics(server.url)
    # 8 measured requests + 1 warm-up of 4 tokens
    assert after["paged:generation_tokens_total"] - before["paged:generation_tokens_total"] == 8 * 6 + 4
    assert after["paged:prompt_tokens_total"] - before["paged:prompt_tokens_total"] == 9 * 24
    assert "output tok/s" in proc.stdout


def test_text_prompts_have_exact_length(server):
    async def main():
        async with httpx.AsyncClient(base_url=server.url) as c:
            rng = random.Random(1)
            texts = [await bench_serve.text_prompt(c, "paged", server.model, n, rng) for n in (7, 64)]
            counts = [(await c.post("/tokenize", json={"prompt": t})).json()["count"] for t in texts]
        return counts

    assert asyncio.run(main()) == [7, 64]


def test_bad_arguments_are_one_line_errors():
    proc = subprocess.run([sys.executable, "-m", "paged.core.bench.serve", "--max-concurrency", "0,x"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--max-concurrency" in proc.stderr and "Traceback" not in proc.stderr


def test_serving_peers_repeat_pairs_rounds(server, tmp_path):
    """benchmarks/serving_peers.py --repeat: every round measures every
    server at every level, with fresh prompts, and the ratios are paired by
    round (the same server under two names here, so each ratio is ~1)."""
    from conftest import BENCHMARKS, load_benchmark

    peers = load_benchmark("serving_peers")
    a, b = ("a", "u", "paged"), ("b", "u", "paged")
    assert peers.schedule([a, b], [1, 4], 2) == [(0, 1, a), (0, 1, b), (0, 4, a), (0, 4, b),
                                               (1, 1, b), (1, 1, a), (1, 4, b), (1, 4, a)]
    assert peers.schedule([a, b], [1, 4], 1) == [(0, 1, a), (0, 4, a), (0, 1, b), (0, 4, b)]
    # prompts: seed S + C + 1000 r, so runs with another --seed on the same servers miss their prefix caches
    seed_of = lambda argv: int(argv[argv.index("--seed") + 1])  # noqa: E731
    ns = SimpleNamespace(input_len=24, output_len=4, seed=100)
    assert [seed_of(peers.bench_argv("u", "paged", 4, ns, r)) for r in (0, 1)] == [104, 1104]
    ns.seed = 5100
    assert seed_of(peers.bench_argv("u", "paged", 4, ns, 0)) == 5104

    out = tmp_path / "peers.json"
    done = subprocess.run([sys.executable, str(BENCHMARKS / "serving_peers.py"), "--server", f"one={server.url}@paged",
                           "--server", f"two={server.url}@paged", "--levels", "2", "--input-len", "24",
                           "--output-len", "4", "--repeat", "2", "--seed", "7", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["seed"] == 7
    for name in ("one", "two"):
        rounds = report["runs"][name]["2"]
        assert len(rounds) == 2 and all(r["completed"] == 8 and r["failed"] == 0 for r in rounds)
        assert report["results"][name]["2"] in rounds
    ratios = report["round_ratios"]["two"]["2"]
    assert len(ratios) == 2 and all(r > 0 for r in ratios)
    assert "median of rounds" in done.stdout


def test_sampling_options_reach_the_request_body():
    p = __import__("argparse").ArgumentParser()
    bench_serve.add_arguments(p)
    greedy = bench_serve.request_body(p.parse_args([]), "m", "hi")
    assert greedy["temperature"] == 0.0 and "top_p" not in greedy
    sampled = bench_serve.request_body(p.parse_args(["--temperature", "0.8", "--top-p", "0.95"]), "m", "hi")
    assert sampled["temperature"] == 0.8 and sampled["top_p"] == 0.95
    for flag, value in (("--temperature", "-1"), ("--temperature", "x"), ("--top-p", "0"), ("--top-p", "1.5")):
        proc = subprocess.run([sys.executable, "-m", "paged.core.bench.serve", flag, value],
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and flag in proc.stderr and "Traceback" not in proc.stderr, (flag, value)
