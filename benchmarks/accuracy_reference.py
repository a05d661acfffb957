"""Writes the accuracy gate's reference data (tests/data/accuracy/reference.json)
from HF transformers float32 (the correctness oracle) and, optionally,
llama.cpp's llama-server on the same GGUF.

    .venv/bin/python benchmarks/accuracy_reference.py [--llama-server URL] [--new-tokens 48]

Inputs (tests/data/accuracy/): prompts_text.json and corpus_text.json, each
{"tune": [...], "check": [...]}. The tuning half may be used freely to
choose a policy; the check half never is (benchmarks/accuracy_gate.py and
tests/test_accuracy_gate.py score on it).

For every prompt (token ids from the model's own tokenizer, no BOS, as the
engine encodes text): HF's greedy continuation of --new-tokens tokens with
every stop token masked (its logit -inf: the continuation never ends
early, and every system is scored on the same decode), the top-2 logit
margin at each step (where a divergence is a near-tie), and, with
--llama-server, llama.cpp's greedy tokens with the same tokens masked
(`ignore_eos` plus a -inf logit bias on each). For every corpus passage: its
token ids and HF's log-probability of each token given the ones before
(the first token has none), for perplexity in nats per token.

Needs `pip install transformers` (the test extra has it); the llama-server
is built as ../shared/PEERS.md says. Prints a summary; the JSON is
rewritten whole.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(__file__))
from timing import positive_int  # noqa: E402

DATA = Path(__file__).resolve().parents[1] / "tests" / "data" / "accuracy"


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def hf_model(path: str):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32).eval()


def hf_greedy(model, ids: list[int], new_tokens: int, masked: list[int]) -> tuple[list[int], list[float]]:
    """Argmax over HF's logits with ``masked`` at -inf, step by step on its
    KV cache: (tokens, top-2 margins in logits)."""
    tokens, margins = [], []
    past, inp = None, torch.tensor([ids])
    with torch.inference_mode():
        for _ in range(new_tokens):
            out = model(input_ids=inp, past_key_values=past, use_cache=True)
            past, logits = out.past_key_values, out.logits[0, -1].float().clone()
            logits[masked] = -float("inf")
            top = torch.topk(logits, 2)
            tokens.append(int(top.indices[0]))
            margins.append(round(float(top.values[0] - top.values[1]), 5))
            inp = torch.tensor([[tokens[-1]]])
    return tokens, margins


def hf_token_logprobs(model, ids: list[int]) -> list[float]:
    """log p(ids[i] | ids[:i]) for i >= 1."""
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    lp = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    return [round(float(x), 6) for x in lp]


def llama_server_greedy(url: str, ids: list[int], new_tokens: int, masked: list[int]) -> list[int]:
    import httpx

    r = httpx.post(url.rstrip("/") + "/completion", timeout=600, json={
        "prompt": ids, "n_predict": new_tokens, "temperature": 0.0, "top_k": 1, "repeat_penalty": 1.0,
        "ignore_eos": True, "logit_bias": [[t, False] for t in masked], "cache_prompt": False,
        "return_tokens": True, "samplers": ["top_k"]})
    r.raise_for_status()
    return r.json()["tokens"][:new_tokens]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a .gguf file (default: the default model)")
    ap.add_argument("--new-tokens", type=positive_int, default=48)
    ap.add_argument("--llama-server", default=None, metavar="URL")
    ap.add_argument("--out", default=str(DATA / "reference.json"))
    ap.add_argument("--halves", default="tune,check", help="which halves to make (another file's check only: check)")
    args = ap.parse_args()
    from paged.core.models.loaders import load_model_files
    from paged.core.models.files import resolve_model

    path = str(resolve_model(args.model, quiet=True))
    loaded = load_model_files(path, torch.float32, quiet=True, keep_packed=True)
    tok, masked = loaded.tokenizer, list(loaded.config.stop_token_ids)
    prompts = json.loads((DATA / "prompts_text.json").read_text())
    corpus = json.loads((DATA / "corpus_text.json").read_text())
    model = hf_model(path)
    out = {"model": {"file": os.path.basename(path), "sha256": sha256(path)}, "new_tokens": args.new_tokens,
           "masked_tokens": masked, "llama.cpp": bool(args.llama_server), "prompts": {}, "corpus": {}}
    halves = [h for h in args.halves.split(",") if h]
    for half in halves:
        rows = []
        for i, text in enumerate(prompts[half]):
            ids = tok.encode(text)
            tokens, margins = hf_greedy(model, ids, args.new_tokens, masked)
            row = {"ids": ids, "hf": tokens, "hf_margins": margins}
            if args.llama_server:
                row["llama.cpp"] = llama_server_greedy(args.llama_server, ids, args.new_tokens, masked)
            rows.append(row)
            print(f"{half} prompt {i}: {len(ids)} tokens", file=sys.stderr)
        out["prompts"][half] = rows
        out["corpus"][half] = [{"ids": (ids := tok.encode(text)), "hf_logprobs": hf_token_logprobs(model, ids)}
                               for text in corpus[half]]
    Path(args.out).write_text(json.dumps(out, separators=(",", ":")) + "\n")
    for half in halves:
        rows, passages = out["prompts"][half], out["corpus"][half]
        nll = -sum(sum(p["hf_logprobs"]) for p in passages) / sum(len(p["hf_logprobs"]) for p in passages)
        print(f"{half}: {len(rows)} prompts x {args.new_tokens} tokens; corpus {len(passages)} passages, "
              f"{sum(len(p['ids']) for p in passages)} tokens, HF {nll:.4f} nats/token")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
