"""Greedy tokens through the full Engine (float32, CPU backend) equal HF
transformers' on the same GGUF, token for token, on three paths:

- exact: float32 activations and cache (--linear-activations float32),
- int8x2: two-term int8 activations, float32 cache,
- auto: the default (mixed activations, float16 cache; docs/kernels.md,
  "Choosing the CPU path"): one int8 term in the middle layers' O, gate/up
  and down projections.

Where the engine picks a different token, HF's logit for it must trail HF's
choice by less than the path's NEAR_TIE (a near-tie that a different but
correct summation order, or the path's documented rounding, can flip); the
rest of that prompt is then not compared. The largest logprob difference
over the compared steps is printed (pytest -s) and bounded per path, and so
is the number of tokens compared; the bounds tell the paths apart (int8
everywhere fails auto's). The held-out measure is tests/test_accuracy_gate.py.
"""

import os

import pytest
import torch

from paged.core.engine.engine import Engine
from paged.core.engine.config import EngineConfig
from paged.core.entrypoints.llm import LLM
from paged.core.engine.sampling_params import SamplingParams

transformers = pytest.importorskip("transformers")

PROMPTS = [
    "The capital of France is",
    "def quicksort(arr):\n",
    "Translate to French: Good morning, my friend.",
    "Q: What is 17 * 23?\nA:",
    "Les étoiles brillent dans le ciel — 星空",
    "<|im_start|>user\nWrite a haiku about rain.<|im_end|>\n<|im_start|>assistant\n",
    "1. Apples\n2. Bananas\n3.",
    "In a hole in the ground there lived",
]
NEW_TOKENS = 32
# path: (engine options, NEAR_TIE: the largest HF top-2 margin a divergence may have, logprob bound,
# tokens that must be compared before the first divergences, of 8 x 32)
PATHS = {"exact": (dict(linear_activations="float32"), 1e-3, 1e-2, 240),
         # 16-bit activation codes: a divergence seen at a margin of 0.0024 (prompt 7, step 31)
         "int8x2": (dict(linear_activations="int8x2", kv_cache_dtype="float32"), 1e-2, 1e-2, 240),
         # one int8 term in the middle layers' O, gate/up and down: measured 2026-12-04 on Zen 3, divergences at
         # HF margins up to 0.054, max |logprob diff| 0.27, 219 tokens compared. int8 everywhere (below the
         # accuracy contract, docs/accuracy.md) measured 0.22, 0.48 and 184 here: these bounds fail it
         "auto": (dict(), 0.15, 0.4, 200)}


@pytest.fixture(scope="module", params=list(PATHS))
def ours(request, default_model_path, isa_level):
    options, near_tie, lp_bound, min_compared = PATHS[request.param]
    engine = Engine(EngineConfig(model=str(default_model_path), device="cpu", dtype="float32",
                                 max_model_len=256, max_num_seqs=8, kv_cache_memory="64MiB",
                                 cpu_threads_bind=str(min(os.sched_getaffinity(0))), **options))
    llm = LLM.from_engine(engine)
    ids = [engine.tokenizer.encode(p) for p in PROMPTS]
    outs = llm.generate(ids, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=5))
    return ids, [o.outputs[0] for o in outs], near_tie, lp_bound, min_compared


@pytest.fixture(scope="module")
def hf_model(default_model_path):
    path = str(default_model_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32)
    return model.eval()


def hf_greedy(model, ids):
    """Plain argmax loop over HF's forward with its KV cache (no logits processors)."""
    tokens, logits = [], []
    past, inp = None, torch.tensor([ids])
    with torch.inference_mode():
        for _ in range(NEW_TOKENS):
            out = model(input_ids=inp, past_key_values=past, use_cache=True)
            past, last = out.past_key_values, out.logits[0, -1].float()
            tokens.append(int(last.argmax()))
            logits.append(last)
            inp = torch.tensor([[tokens[-1]]])
    return tokens, logits


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")
def test_greedy_tokens_equal_hf(ours, hf_model):
    ids, completions, near_tie, lp_bound, min_compared = ours
    max_lp_diff, near_ties, compared = 0.0, [], 0
    for p, (prompt_ids, comp) in enumerate(zip(ids, completions)):
        ref_tokens, ref_logits = hf_greedy(hf_model, prompt_ids)
        for step, (mine, ref) in enumerate(zip(comp.token_ids, ref_tokens)):
            logits = ref_logits[step]
            ref_lp = torch.log_softmax(logits, -1)
            for tok, lp in comp.logprobs[step].items():
                max_lp_diff = max(max_lp_diff, abs(lp - ref_lp[tok].item()))
            if mine != ref:
                # a near-tie: in HF's logits our choice trails HF's by less than the path's NEAR_TIE
                margin = (logits[ref] - logits[mine]).item()
                assert margin < near_tie, (
                    f"prompt {p} step {step}: engine chose {mine}, HF chose {ref}, {margin:.4g} logits better")
                near_ties.append((p, step, margin))
                break
            compared += 1
    print(f"\nengine vs HF float32: {compared} greedy tokens compared, max |logprob diff| over the top-5 = "
          f"{max_lp_diff:.3g}, near-ties: {near_ties or 'none'}")
    assert max_lp_diff < lp_bound
    assert compared >= min_compared
