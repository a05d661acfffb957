"""Offline API: batch generation without a server.

    from paged import LLM, SamplingParams
    llm = LLM()                                   # the default model, best device
    llm = LLM(tensor_parallel_size=2)             # sharded over 2 ranks (docs/distributed.md); llm.close() ends them
    outs = llm.generate(["Hello", "2 + 2 ="], SamplingParams(max_tokens=16))
    print(outs[0].outputs[0].text)
    llm.chat([{"role": "user", "content": "Hi!"}])

    # vLLM's prompt forms, mixed freely with strings and token ids (core/entrypoints/prompts.py)
    llm.generate([{"prompt": "Hello"}, {"prompt_token_ids": [1, 2, 3]}, "Hi", [4, 5]],
                 sampling_params=SamplingParams(max_tokens=8))

    from paged.core.engine.sampling_params import StructuredOutputsParams
    llm.generate("A person as JSON:", SamplingParams(max_tokens=64,
                 structured_outputs=StructuredOutputsParams(json={"type": "object"})))
"""

from __future__ import annotations

import itertools
from typing import Callable, Optional, Sequence

from paged.core.engine.engine import Engine
from paged.core.engine.config import EngineConfig
from paged.core.engine.outputs import RequestOutput
from paged.core.engine.sampling_params import SamplingParams
from paged.core.entrypoints.prompts import Prompt, conversations_of, prompts_of

Messages = list[dict]


def normalize_prompts(prompts, vocab_size: Optional[int] = None) -> list[Prompt]:
    """One prompt or a list of them (strings, token ids, vLLM's {"prompt"} /
    {"prompt_token_ids"} dicts, mixed) -> a list of engine prompts."""
    return prompts_of(prompts, vocab_size)


def _params_argument(params, sampling_params):
    """``params`` or vLLM's keyword ``sampling_params``, not both."""
    if sampling_params is not None and params is not None:
        raise ValueError("sampling_params: expected it or params, not both, got both")
    return sampling_params if sampling_params is not None else params


def normalize_params(params, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(n)]
    if isinstance(params, SamplingParams):
        return [params] * n
    if isinstance(params, (list, tuple)) and all(isinstance(p, SamplingParams) for p in params):
        if len(params) != n:
            raise ValueError(f"params has {len(params)} entries for {n} prompts (give one, or one per prompt)")
        return list(params)
    raise ValueError(f"params must be a SamplingParams or a list of them, got {type(params).__name__}")


class LLM:
    def __init__(self, model: Optional[str] = None, device: str = "auto", dtype: str = "auto", **engine_options):
        # Offline generation is throughput-first: nobody waits between tokens, so
        # prompts are not throttled to an inter-token latency target unless asked
        # (itl_target_ms=...); the server keeps EngineConfig's default.
        engine_options.setdefault("itl_target_ms", None)
        self.engine = Engine(EngineConfig(model=model, device=device, dtype=dtype, **engine_options))
        self._ids = itertools.count()

    def close(self) -> None:
        """Ends the engine's tensor parallel group (its other ranks exit);
        nothing to do for one rank. ``with LLM(...) as llm:`` calls it."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @classmethod
    def from_engine(cls, engine: Engine) -> "LLM":
        """Wraps an existing engine (shares its loaded model)."""
        llm = cls.__new__(cls)
        llm.engine = engine
        llm._ids = itertools.count()
        return llm

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts, params=None,
                 on_output: Optional[Callable[[RequestOutput], None]] = None, *,
                 sampling_params=None) -> list[RequestOutput]:
        """Runs every prompt to completion, batched; outputs in input order.
        ``prompts``: one prompt or a list (strings, token-id lists, vLLM's
        ``{"prompt": ...}`` / ``{"prompt_token_ids": [...]}``, mixed).
        ``on_output`` sees every intermediate output (for streaming)."""
        plist = prompts_of(prompts, self.engine.model_config.vocab_size)
        return self._run(plist, normalize_params(_params_argument(params, sampling_params), len(plist)),
                         on_output)

    def chat(self, messages, params=None,
             on_output: Optional[Callable[[RequestOutput], None]] = None, *,
             sampling_params=None) -> list[RequestOutput]:
        """One conversation ([{"role", "content"}, ...]; content a string or
        OpenAI's text parts) or a list of them, rendered with the model's
        chat template."""
        convs = conversations_of(messages)
        tok = self.engine.tokenizer
        prompts = []
        for i, c in enumerate(convs):
            try:
                text = tok.apply_chat_template(c, add_generation_prompt=True)
            except Exception as exc:  # noqa: BLE001 - the template refused the conversation
                where = "messages" if len(convs) == 1 else f"messages[{i}]"
                raise ValueError(f"{where}: expected a conversation the chat template accepts, got one it "
                                 f"refuses ({' '.join(str(exc).split())[:200]})") from None
            prompts.append(tok.encode(text, add_special_tokens=False))
        return self._run(prompts, normalize_params(_params_argument(params, sampling_params), len(prompts)),
                         on_output)

    def _run(self, prompts: Sequence[Prompt], params: list[SamplingParams],
             on_output: Optional[Callable[[RequestOutput], None]]) -> list[RequestOutput]:
        engine = self.engine
        self._compile_constraints(params)
        ids = [f"llm-{next(self._ids)}" for _ in prompts]
        added: list[str] = []
        try:
            for i, (rid, prompt, p) in enumerate(zip(ids, prompts, params)):
                try:
                    engine.add_request(rid, prompt, p)
                except ValueError as exc:  # name the prompt among several
                    raise (ValueError(f"prompts[{i}]: {exc}") if len(prompts) > 1 else exc) from None
                added.append(rid)
            final: dict[str, RequestOutput] = {}
            while len(final) < len(ids) and engine.has_unfinished_requests():
                for out in engine.step():
                    if on_output is not None:
                        on_output(out)
                    if out.finished:
                        final[out.request_id] = out
        except BaseException:
            for rid in added:  # leave the engine clean (e.g. Ctrl-C in the REPL)
                engine.abort_request(rid)
            raise
        return [final[rid] for rid in ids]

    def _compile_constraints(self, params: list[SamplingParams]) -> None:
        """Compiles every structured-output constraint up front (cached per
        constraint), so a bad schema is a ValueError here, before any request
        runs, rather than a failed request later."""
        for p in params:
            if p.structured_outputs is not None:
                self.engine.grammars.compiler.compile(p.structured_outputs)

