"""The accuracy gate: paged's CPU compute paths scored against HF
transformers float32 (and llama.cpp) on held-out data, with the floors each
path must meet.

    .venv/bin/python benchmarks/accuracy_gate.py [--half check] [--paths auto,float32,...] [--quick] [--json PATH]

Data (tests/data/accuracy/, made by benchmarks/accuracy_reference.py):
prompts and corpus passages as token ids, split into a tuning half (use it
freely to choose a policy) and a check half (never used to choose one);
HF float32's greedy tokens with the stop tokens masked, its top-2 margin at
every step and its log-probability of every corpus token; llama.cpp's
greedy tokens. floors.json holds the floors, measured once on the check half
and written down with how each was derived.

Per path (--paths; a name from PATHS, or NAME@KV for another
--kv-cache-dtype):
- agree: greedy tokens produced before the first difference from HF's,
  summed over prompts (stop tokens masked the same way as the reference);
  first: prompts whose first token equals HF's; near-ties: divergences
  where HF's top-2 margin was below 0.01 logits;
- nats: mean |log p_paged - log p_HF| per corpus token, with the corpus
  computed as prompt rows (prompt_logprobs) and, "gen nats", with every row
  computed as a row that generates a token (where "mixed" spends its second
  int8 term); the signed mean (the perplexity ratio's log) is reported too.

Exits 1 when a path misses a floor of floors.json (paths without floors
are reported only), 0 otherwise. --quick scores the quick subset (the
first prompts and passages of the half, as floors.json's "quick" says) that
the default test suite runs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(__file__))
from timing import emit_json  # noqa: E402

DATA = Path(__file__).resolve().parents[1] / "tests" / "data" / "accuracy"
#: a divergence where HF's top-2 margin is below this is a near-tie
NEAR_TIE = 0.01
#: engine options per path ("auto": what a user gets with no flags)
PATHS = {"auto": {},
         "mixed": dict(linear_activations="mixed"),
         "mixed-bf16": dict(linear_activations="mixed-bf16"),
         "float32": dict(linear_activations="float32"),
         "int8x2": dict(linear_activations="int8x2"),
         "int8": dict(linear_activations="int8"),
         "bfloat16": dict(dtype="bfloat16", linear_activations="float32")}


def load_data(reference: str | None = None) -> tuple[dict, dict]:
    """(reference.json, floors.json) as dicts; ``reference``: another file's
    reference data (benchmarks/accuracy_reference.py --model F --out PATH),
    scored without floors (they are the default model's)."""
    ref = json.loads(Path(reference or DATA / "reference.json").read_text())
    floors = json.loads((DATA / "floors.json").read_text())
    return ref, (floors if reference is None else {**floors, "paths": {}, "quick": {**floors["quick"], "paths": {}}})


def path_options(name: str) -> dict:
    """Engine options of a path name (PATHS, or NAME@KV); ValueError otherwise."""
    base, _, kv = name.partition("@")
    if base not in PATHS:
        raise ValueError(f"path: expected one of {', '.join(PATHS)} (optionally @KV_CACHE_DTYPE), got {name!r}")
    return dict(PATHS[base], **({"kv_cache_dtype": kv} if kv else {}))


def unavailable(name: str) -> str | None:
    """Why this machine cannot run the path, or None."""
    from paged.backends.cpu.quant_linear import bf16_prompt_supported

    if name.partition("@")[0] == "mixed-bf16" and not bf16_prompt_supported():
        return "mixed-bf16 needs AMX-BF16 tiles (Intel Xeon from Sapphire Rapids on), which this CPU lacks"
    return None


def subset(reference: dict, half: str, quick: dict | None) -> tuple[list[dict], list[dict]]:
    """The half's prompts and passages, or their quick subset."""
    prompts, passages = reference["prompts"][half], reference["corpus"][half]
    if quick:
        prompts, passages = prompts[:quick["prompts"]], passages[:quick["passages"]]
    return prompts, passages


def agreement(ours: list[int], ref: list[int]) -> int:
    """Tokens before the first difference."""
    n = 0
    for a, b in zip(ours, ref):
        if a != b:
            break
        n += 1
    return n


@dataclass
class PathScore:
    name: str
    agree_per_prompt: list[int] = field(default_factory=list)
    first: int = 0
    near_ties: int = 0
    nats: float | None = None  # mean |delta log p|, prompt rows
    nats_signed: float | None = None
    gen_nats: float | None = None  # mean |delta log p|, generating rows
    gen_nats_signed: float | None = None

    @property
    def agree(self) -> int:
        return sum(self.agree_per_prompt)

    def as_dict(self) -> dict:
        return {"agree": self.agree, "first": self.first, "near_ties": self.near_ties, "nats": self.nats,
                "nats_signed": self.nats_signed, "gen_nats": self.gen_nats, "gen_nats_signed": self.gen_nats_signed,
                "agree_per_prompt": self.agree_per_prompt}


def score_tokens(score: PathScore, outs: list[list[int]], prompts: list[dict]) -> None:
    for tokens, p in zip(outs, prompts):
        n = agreement(tokens, p["hf"])
        score.agree_per_prompt.append(n)
        score.first += int(n > 0)
        score.near_ties += int(n < len(p["hf"]) and p["hf_margins"][n] < NEAR_TIE)


def nats(ours: list[list[float]], passages: list[dict]) -> tuple[float, float]:
    """(mean |delta|, mean delta) of per-token log-probabilities against HF's."""
    diffs = [a - b for lps, p in zip(ours, passages) for a, b in zip(lps, p["hf_logprobs"])]
    return sum(abs(d) for d in diffs) / len(diffs), -sum(diffs) / len(diffs)


def run_path(model_path: str, name: str, reference: dict, prompts: list[dict], passages: list[dict]) -> PathScore:
    """Greedy tokens and corpus log-probabilities of one path, scored."""
    from paged.core.engine.engine import Engine
    from paged.core.engine.config import EngineConfig
    from paged.core.entrypoints.llm import LLM
    from paged.core.engine.sampling_params import SamplingParams

    longest = max(len(p["ids"]) for p in passages + prompts) + reference["new_tokens"] + 1
    # batches fixed by the token budget alone (no step-time target) and threads pinned to every allowed CPU:
    # paths that are not batch invariant (bfloat16) then score the same on every run on one machine
    cpus = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))
    engine = Engine(EngineConfig(model=model_path, device="cpu", max_model_len=max(longest, 256),
                                 kv_cache_memory="256MiB", max_num_seqs=16, itl_target_ms=None,
                                 cpu_threads_bind=cpus, **path_options(name)))
    try:
        llm = LLM.from_engine(engine)
        masked = {t: -100.0 for t in reference["masked_tokens"]}  # -100: never chosen, as HF's -inf
        greedy = SamplingParams(temperature=0.0, max_tokens=reference["new_tokens"], ignore_eos=True,
                                logit_bias=masked)
        score = PathScore(name)
        outs = llm.generate([p["ids"] for p in prompts], greedy)
        score_tokens(score, [o.outputs[0].token_ids for o in outs], prompts)
        scoring = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
        rows = llm.generate([p["ids"] for p in passages], scoring)
        prompt_lps = [[lps[t] for t, lps in zip(p["ids"][1:], o.prompt_logprobs[1:])] for o, p in zip(rows, passages)]
        score.nats, score.nats_signed = nats(prompt_lps, passages)
        # last: it writes the idle engine's cache blocks
        score.gen_nats, score.gen_nats_signed = nats(generating_logprobs(engine.runner, passages), passages)
    finally:
        engine.platform.release_thread()
    return score


def generating_logprobs(runner, passages: list[dict]) -> list[list[float]]:
    """log p of each passage token with every row computed as a row that
    generates a token (first_prompt_row past the last row), one passage per
    forward: prompt_logprobs scores prompt rows, which "mixed" computes more
    cheaply, so only this sees what a path does to the rows that pick the
    tokens. Writes the KV cache from block 0: call it on an idle engine that
    serves nothing afterwards."""
    from paged.backends.base import AttentionMetadata

    out = []
    with torch.inference_mode():
        for p in passages:
            ids, t = p["ids"], len(p["ids"])
            blocks = -(-t // runner.block_size)
            meta = AttentionMetadata(
                slot_mapping=torch.arange(t, dtype=torch.int64), query_start_loc=torch.tensor([0, t], dtype=torch.int32),
                seq_lens=torch.tensor([t], dtype=torch.int32),
                block_tables=torch.arange(blocks, dtype=torch.int32).view(1, blocks), num_decodes=0,
                max_query_len=t, max_seq_len=t)
            meta.first_prompt_row = t  # every row generates
            hidden = runner.model(torch.tensor(ids), torch.arange(t), runner.kv_caches, meta)
            logits = runner.model.compute_logits(hidden[:-1]).float()
            lp = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
            out.append(lp.tolist())
    return out


def llama_cpp_score(prompts: list[dict]) -> PathScore | None:
    """llama.cpp's stored greedy tokens, scored like a path (None when the
    reference has none)."""
    if not all("llama.cpp" in p for p in prompts):
        return None
    score = PathScore("llama.cpp")
    score_tokens(score, [p["llama.cpp"] for p in prompts], prompts)
    return score


def auto_floor(floors: dict, prompts_taken: int, llama: PathScore | None) -> int:
    """What a path `auto` may choose must agree on: max(llama.cpp, the
    bfloat16 path) over the scored prompts (bfloat16's per-prompt counts
    are floors.json's, measured once on the check half)."""
    bf16 = sum(floors["bfloat16_agree_per_prompt"][:prompts_taken])
    return max(bf16, llama.agree if llama else 0)


def misses(score: PathScore, floor: dict, auto_min: int | None) -> list[str]:
    """The floors a path misses, as readable lines (empty: it passes)."""
    out = []
    need = auto_min if floor.get("agree") == "auto" else floor.get("agree")
    if need is not None and score.agree < need:
        out.append(f"agree {score.agree} < {need}")
    if "first" in floor and score.first < floor["first"]:
        out.append(f"first {score.first} < {floor['first']}")
    for key in ("nats", "gen_nats"):
        if key in floor and getattr(score, key) > floor[key]:
            out.append(f"{key} {getattr(score, key):.4f} > {floor[key]}")
    return out


def gate(names: list[str], half: str = "check", quick: bool = False, model: str | None = None,
         reference: str | None = None) -> dict:
    """Scores every path (and llama.cpp) on the half, or its quick subset,
    against floors.json: {"rows": {name: score dict}, "skipped": {name:
    why}, "failed": {name: [misses]}, "auto_floor": int}."""
    from paged.core.models.files import resolve_model

    reference, floors = load_data(reference)
    section = floors["quick"] if quick else floors
    prompts, passages = subset(reference, half, section if quick else None)
    model_path = str(resolve_model(model, quiet=True))
    llama = llama_cpp_score(prompts)
    auto_min = auto_floor(floors, len(prompts), llama) if half == "check" and floors["paths"] else None
    report = {"half": half, "quick": quick, "prompts": len(prompts), "new_tokens": reference["new_tokens"],
              "corpus_tokens": sum(len(p["ids"]) for p in passages), "auto_floor": auto_min, "rows": {},
              "skipped": {}, "failed": {}}
    if llama is not None:
        report["rows"]["llama.cpp"] = llama.as_dict()
    for name in names:
        why = unavailable(name)
        if why:
            report["skipped"][name] = why
            continue
        score = run_path(model_path, name, reference, prompts, passages)
        report["rows"][name] = score.as_dict()
        floor = section["paths"].get(name) if half == "check" else None
        if floor is not None:
            missed = misses(score, floor, auto_min)
            if missed:
                report["failed"][name] = missed
    return report


def print_report(report: dict) -> None:
    n = report["prompts"] * report["new_tokens"]
    print(f"{report['half']} half{' (quick subset)' if report['quick'] else ''}: {report['prompts']} prompts x "
          f"{report['new_tokens']} greedy tokens vs HF float32 (stop tokens masked); corpus "
          f"{report['corpus_tokens']} tokens; auto's floor {report['auto_floor']} = max(llama.cpp, bfloat16)")
    print(f"{'path':<16}{'agree':>12}{'first':>7}{'near-ties':>10}{'nats':>9}{'(signed)':>10}{'gen nats':>10}"
          f"{'(signed)':>10}  gate")
    fmt = lambda v: "-" if v is None else f"{v:.4f}"  # noqa: E731
    for name, r in report["rows"].items():
        verdict = "; ".join(report["failed"][name]) if name in report["failed"] else "pass"
        print(f"{name:<16}{r['agree']:>6}/{n:<5}{r['first']:>7}{r['near_ties']:>10}{fmt(r['nats']):>9}"
              f"{fmt(r['nats_signed']):>10}{fmt(r['gen_nats']):>10}{fmt(r['gen_nats_signed']):>10}  {verdict}")
    for name, why in report["skipped"].items():
        print(f"{name:<16} skipped: {why}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a .gguf file (default: the default model, which the data is for)")
    ap.add_argument("--half", choices=("check", "tune"), default="check")
    ap.add_argument("--paths", default="auto,float32,int8x2,bfloat16,int8,mixed-bf16",
                    help=f"comma list of {', '.join(PATHS)}; NAME@KV also sets --kv-cache-dtype KV")
    ap.add_argument("--quick", action="store_true", help="the quick subset the default test suite runs")
    ap.add_argument("--reference", default=None, metavar="PATH",
                    help="another file's reference data (with --model that file; scored without floors)")
    ap.add_argument("--json", default=None, metavar="PATH")
    args = ap.parse_args()
    names = [n for n in args.paths.split(",") if n]
    try:
        for n in names:
            path_options(n)
    except ValueError as exc:
        ap.error(str(exc))
    report = gate(names, args.half, args.quick, args.model, args.reference)
    print_report(report)
    emit_json(report, args.json)
    return 1 if report["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
