"""`paged generate "prompt" ...` and `paged chat` (interactive, or piped stdin).

Both stream text to stdout as it is generated. Called by core/entrypoints/cli.py, which
has already chosen the platform (args.device).
"""

from __future__ import annotations

import argparse
import sys

from paged.core.engine.config import add_engine_args, engine_config_from_args
from paged.core.engine.sampling_params import SamplingParams


def _add_sampling_args(parser: argparse.ArgumentParser, max_tokens: int) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens, help=f"tokens to generate (default: {max_tokens})")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: 0)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--sampling-seed", type=int, default=None, help="per-request seed (reproducible sampling)")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")


def _sampling_params(args) -> SamplingParams:
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                          seed=args.sampling_seed, stop=args.stop, ignore_eos=args.ignore_eos)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompts", nargs="*", help="prompt(s); none: read one prompt from stdin")
    add_engine_args(parser)
    _add_sampling_args(parser, max_tokens=128)


def add_chat_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--system", default=None, help="system prompt (default: the template's)")
    add_engine_args(parser)
    _add_sampling_args(parser, max_tokens=512)


def _make_llm(args):
    from paged.core.entrypoints.llm import LLM

    params = _sampling_params(args)  # validate before the slow model load
    cfg = engine_config_from_args(args)
    return LLM(**vars(cfg)), params


class _Streamer:
    """Prints the growing text of one request as its outputs arrive."""

    def __init__(self, out=sys.stdout):
        self.out = out
        self.shown = 0

    def __call__(self, ro) -> None:
        text = ro.outputs[0].text
        if len(text) > self.shown:
            self.out.write(text[self.shown:])
            self.out.flush()
            self.shown = len(text)


def run(args) -> int:
    prompts = args.prompts or [sys.stdin.read()]
    if not any(p.strip() for p in prompts):
        raise ValueError("no prompt given (pass it as an argument or on stdin)")
    llm, params = _make_llm(args)
    with llm:  # a tensor parallel group ends with the command
        if len(prompts) == 1:
            llm.generate(prompts[0], params, on_output=_Streamer())
            print()
            return 0
        for i, out in enumerate(llm.generate(prompts, params)):
            print(f"--- [{i}] {prompts[i]!r}")
            print(out.outputs[0].text)
    return 0


def run_chat(args) -> int:
    llm, params = _make_llm(args)
    with llm:  # a tensor parallel group ends with the command
        return _chat_loop(args, llm, params)


def _chat_loop(args, llm, params) -> int:
    messages = [{"role": "system", "content": args.system}] if args.system else []
    interactive = sys.stdin.isatty()
    if interactive:
        print("paged chat: type a message, Ctrl-D to quit, /reset to start over.", file=sys.stderr)
    while True:
        if interactive:
            sys.stderr.write(">>> ")
            sys.stderr.flush()
        line = sys.stdin.readline()
        if not line:
            break
        line = line.strip()
        if not line:
            continue
        if line == "/reset":
            messages = messages[:1] if args.system else []
            continue
        messages.append({"role": "user", "content": line})
        stream = _Streamer()
        try:
            out = llm.chat(messages, params, on_output=stream)[0]
        except KeyboardInterrupt:
            print("\n[interrupted]", file=sys.stderr)
            messages.pop()
            continue
        print()
        messages.append({"role": "assistant", "content": out.outputs[0].text})
    return 0
