"""The accuracy gate a CPU compute path must pass to become `auto`.

    .venv/bin/python benchmarks/accuracy_gate.py [--llama-server URL] [--json PATH]

Two measures, on the default model (or --model), against HF transformers
loading the same GGUF in float32 (the correctness oracle):

1. Greedy agreement: each fixed prompt is continued --new-tokens tokens
   greedily (EOS ignored); a system scores the tokens it produces before its
   first divergence from HF, summed over prompts. With --llama-server URL (a
   llama.cpp `llama-server` on the same GGUF, ../shared/PEERS.md) llama.cpp
   is scored the same way. Gate: a paged path scores >= llama.cpp.
2. Perplexity on a fixed offline English corpus: the docstrings of the
   CPython standard library modules of this interpreter, sorted by module
   name, cut into --window-token windows (--ppl-tokens in all). Gate: within
   1% of paged's float32 path. Scored through prompt_logprobs, i.e. on
   prompt rows; "gen ppl" (reported, not gated) scores the same windows with
   every row computed as a row that generates a token, which is where
   "mixed" spends its second int8 term.

Paths measured: --dtype float32 with float32, int8, int8x2, mixed and mixed-bf16 linear
activations, and bfloat16; `--paths int8x2@float16` runs a path with that --kv-cache-dtype.
Prints a table, then JSON (--json PATH also writes it).
"""

from __future__ import annotations

import argparse
import ast
import math
import os
import sys
import sysconfig

import torch

sys.path.insert(0, os.path.dirname(__file__))
from timing import emit_json  # noqa: E402

PROMPTS = [
    "The capital of France is", "def quicksort(arr):", "Once upon a time, in a small village,",
    "The three primary colors are", "Water boils at a temperature of", "In 1492, Christopher Columbus",
    "To make a cup of tea, first", "The largest planet in our solar system", "import numpy as np\n\n",
    "Photosynthesis is the process by which", "My favourite book is", "The French Revolution began",
    "Here is a list of fruits:\n1.", "SELECT name FROM users WHERE", "The theory of relativity states that",
    "Dear Sir or Madam,\n\nI am writing to",
    "The human heart has four chambers:", "A good night's sleep helps", "for i in range(10):\n   ",
    "The Great Wall of China was built", "Rain forms when", "Shakespeare wrote many plays, including",
    "The recipe calls for two cups of", "In mathematics, a prime number is", "The stock market fell today after",
    "Bees are important because", "#include <stdio.h>\n\nint main(void) {", "The Amazon river flows through",
    "Yesterday I went to the market and bought", "A haiku about the ocean:\n", "The speed of light is about",
    "Mount Everest is located in", "def add(a, b):\n    \"\"\"", "The first man to walk on the Moon was",
    "Climate change is caused by", "Q: What is 12 times 12?\nA:", "The Mona Lisa was painted by",
    "To reset your password, click", "An apple a day", "The most spoken languages in the world are",
    "Electric cars are becoming popular because", "The Roman Empire fell in", "function greet(name) {",
    "The main ingredients of bread are", "Volcanoes erupt when", "My grandmother always told me",
    "The Internet was invented", "A triangle has three sides and", "class Stack:\n    def __init__(self):",
    "Dogs are known for their", "The Pacific Ocean is the", "During the winter, many birds",
    "The law of gravity says that", "Translate to French: Good morning, how are you?\n",
    "Chocolate is made from", "Exercise is good for your health because", "The planet Mars is called",
    "<html>\n<head>\n<title>", "In the year 2050, cities will", "The Nile is the longest river",
    "Vaccines work by", "Summary of the meeting:\n-", "The alphabet starts with", "Coffee originated in",
]
PATHS = {"float32": dict(dtype="float32", linear_activations="float32"),
         "int8": dict(dtype="float32", linear_activations="int8"),
         "int8x2": dict(dtype="float32", linear_activations="int8x2"),
         "mixed": dict(dtype="float32", linear_activations="mixed"),
         "mixed-bf16": dict(dtype="float32", linear_activations="mixed-bf16"),
         "bfloat16": dict(dtype="bfloat16", linear_activations="float32")}


def stdlib_docstrings() -> str:
    """Module docstrings of this interpreter's standard library, sorted by path."""
    root = sysconfig.get_paths()["stdlib"]
    texts = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("test", "tests", "idlelib", "site-packages"))
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            try:
                with open(os.path.join(dirpath, name), encoding="utf-8") as f:
                    doc = ast.get_docstring(ast.parse(f.read()))
            except (SyntaxError, UnicodeDecodeError, ValueError):
                continue
            if doc and len(doc) > 200:
                texts.append(doc)
    return "\n\n".join(texts)


def agreement(ours: list[list[int]], ref: list[list[int]]) -> int:
    """Tokens before the first divergence, summed over prompts."""
    total = 0
    for a, b in zip(ours, ref):
        for x, y in zip(a, b):
            if x != y:
                break
            total += 1
    return total


def hf_greedy_and_nll(model_path: str, prompts, new_tokens: int, windows) -> tuple[list[list[int]], float]:
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(model_path), gguf_file=os.path.basename(model_path), dtype=torch.float32).eval()
    outs = []
    with torch.inference_mode():
        for ids in prompts:
            out = hf.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False, min_new_tokens=new_tokens,
                              repetition_penalty=1.0, pad_token_id=0)
            outs.append(out[0, len(ids):].tolist())
        nll, count = 0.0, 0
        for w in windows:
            logits = hf(torch.tensor([w])).logits[0, :-1].float()
            lp = torch.log_softmax(logits, -1).gather(1, torch.tensor(w[1:])[:, None])
            nll -= lp.sum().item()
            count += len(w) - 1
    return outs, math.exp(nll / count)


def paged_greedy_and_ppl(model_path: str, options: dict, prompts, new_tokens: int, windows):
    from paged.core.engine import Engine
    from paged.core.engine_config import EngineConfig
    from paged.core.llm import LLM
    from paged.core.sampling_params import SamplingParams

    engine = Engine(EngineConfig(model=model_path, device="cpu", max_model_len=2048, kv_cache_memory="512MiB",
                                 **options))
    llm = LLM.from_engine(engine)
    greedy = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    scoring = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    nll, count = 0.0, 0
    for o, w in zip(llm.generate(windows, scoring), windows):
        for tok, lps in zip(w[1:], o.prompt_logprobs[1:]):
            nll -= lps[tok]
            count += 1
    gen_ppl = generating_ppl(engine.runner, windows)  # last: it writes the idle engine's cache blocks
    engine.platform.release_thread()
    return outs, math.exp(nll / count), gen_ppl


def generating_ppl(runner, windows) -> float:
    """Perplexity of the windows with every row computed as a row that
    generates a token (first_prompt_row past the last row), one window per
    forward: prompt_logprobs scores prompt rows, whose arithmetic "mixed"
    makes cheaper, so only this sees what a mode does to the rows that pick
    the tokens. Writes the KV cache from block 0: call it on an idle engine
    that serves nothing afterwards."""
    from paged.backends.base import AttentionMetadata

    nll, count = 0.0, 0
    with torch.inference_mode():
        for w in windows:
            t = len(w)
            blocks = -(-t // runner.block_size)
            meta = AttentionMetadata(
                slot_mapping=torch.arange(t, dtype=torch.int64), query_start_loc=torch.tensor([0, t], dtype=torch.int32),
                seq_lens=torch.tensor([t], dtype=torch.int32),
                block_tables=torch.arange(blocks, dtype=torch.int32).view(1, blocks), num_decodes=0,
                max_query_len=t, max_seq_len=t)
            meta.first_prompt_row = t  # every row generates
            hidden = runner.model(torch.tensor(w), torch.arange(t), runner.kv_caches, meta)
            logits = runner.model.compute_logits(hidden[:-1]).float()
            nll -= torch.log_softmax(logits, -1).gather(1, torch.tensor(w[1:])[:, None]).sum().item()
            count += t - 1
    return math.exp(nll / count)


def llama_server_greedy(url: str, prompts, new_tokens: int) -> list[list[int]]:
    import httpx

    outs = []
    for ids in prompts:
        r = httpx.post(url.rstrip("/") + "/completion", timeout=600, json={
            "prompt": ids, "n_predict": new_tokens, "temperature": 0.0, "top_k": 1, "repeat_penalty": 1.0,
            "ignore_eos": True, "cache_prompt": False, "return_tokens": True, "samplers": ["top_k"]})
        r.raise_for_status()
        outs.append(r.json()["tokens"][:new_tokens])
    return outs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a .gguf file (default: the default model)")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--ppl-tokens", type=int, default=8192)
    ap.add_argument("--window-tokens", type=int, default=512)
    ap.add_argument("--paths", default=",".join(PATHS),
                    help=f"comma list of {', '.join(PATHS)}; PATH@KV also sets --kv-cache-dtype KV")
    ap.add_argument("--llama-server", default=None, metavar="URL")
    ap.add_argument("--json", default=None, metavar="PATH")
    args = ap.parse_args()
    from paged.core.loaders import load_model_files
    from paged.core.model_files import resolve_model

    model_path = str(resolve_model(args.model, quiet=True))
    tok = load_model_files(model_path, torch.float32, quiet=True, keep_packed=True).tokenizer
    prompts = [tok.encode(p) for p in PROMPTS]
    corpus = tok.encode(stdlib_docstrings())[:args.ppl_tokens]
    windows = [corpus[i:i + args.window_tokens] for i in range(0, len(corpus) - 1, args.window_tokens)]
    windows = [w for w in windows if len(w) > 1]

    ref, ref_ppl = hf_greedy_and_nll(model_path, prompts, args.new_tokens, windows)
    rows = {"hf-float32": {"agree": agreement(ref, ref), "ppl": ref_ppl}}
    for name in args.paths.split(","):
        path, _, kv = name.partition("@")
        options = dict(PATHS[path], **({"kv_cache_dtype": kv} if kv else {}))
        outs, ppl, gen_ppl = paged_greedy_and_ppl(model_path, options, prompts, args.new_tokens, windows)
        rows[f"paged-{name}"] = {"agree": agreement(outs, ref), "ppl": ppl, "gen_ppl": gen_ppl}
    if args.llama_server:
        rows["llama.cpp"] = {"agree": agreement(llama_server_greedy(args.llama_server, prompts, args.new_tokens), ref),
                             "ppl": None}
    base = rows.get("paged-float32", {}).get("ppl")
    lcpp = rows.get("llama.cpp", {}).get("agree")
    print(f"{len(prompts)} prompts x {args.new_tokens} greedy tokens vs HF float32; perplexity over "
          f"{sum(len(w) for w in windows)} tokens of stdlib docstrings ({len(windows)} windows)")
    gen_base = rows.get("paged-float32", {}).get("gen_ppl")
    print(f"{'system':<16}{'agree':>7}{'ppl':>10}{'ppl vs fp32':>13}{'gen ppl vs fp32':>17}  gate")
    for name, r in rows.items():
        rel = (r["ppl"] / base - 1) if (r["ppl"] and base) else None
        gate = ""
        if name.startswith("paged-") and name != "paged-float32" and rel is not None:
            ok = abs(rel) <= 0.01 and (lcpp is None or r["agree"] >= lcpp)
            gate = ("pass" if ok else "fail") + ("" if lcpp is not None else " (ppl only: no llama.cpp)")
            r["gate"] = ok
        r["ppl_vs_float32"] = rel
        gen_rel = (r["gen_ppl"] / gen_base - 1) if (r.get("gen_ppl") and gen_base) else None
        r["gen_ppl_vs_float32"] = gen_rel
        ppl = f"{r['ppl']:.4f}" if r["ppl"] else "-"
        print(f"{name:<16}{r['agree']:>7}{ppl:>10}{(f'{rel:+.3%}' if rel is not None else '-'):>13}"
              f"{(f'{gen_rel:+.3%}' if gen_rel is not None else '-'):>17}  {gate}")
    emit_json({"prompts": len(prompts), "new_tokens": args.new_tokens, "max_agree": len(prompts) * args.new_tokens,
               "ppl_tokens": sum(len(w) for w in windows), "rows": rows}, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
