"""Offline API: batch generation without a server.

    from paged import LLM, SamplingParams
    llm = LLM()                                   # the default model, best device
    llm = LLM(tensor_parallel_size=2)             # sharded over 2 ranks (docs/distributed.md); llm.close() ends them
    outs = llm.generate(["Hello", "2 + 2 ="], SamplingParams(max_tokens=16))
    print(outs[0].outputs[0].text)
    llm.chat([{"role": "user", "content": "Hi!"}])

    from paged.core.engine.sampling_params import StructuredOutputsParams
    llm.generate("A person as JSON:", SamplingParams(max_tokens=64,
                 structured_outputs=StructuredOutputsParams(json={"type": "object"})))
"""

from __future__ import annotations

import itertools
from typing import Callable, Optional, Sequence, Union

from paged.core.engine.engine import Engine
from paged.core.engine.config import EngineConfig
from paged.core.engine.outputs import RequestOutput
from paged.core.engine.sampling_params import SamplingParams

Prompt = Union[str, list[int]]
Messages = list[dict]


def _is_token_ids(x) -> bool:
    return isinstance(x, list) and bool(x) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def normalize_prompts(prompts) -> list[Prompt]:
    """str | list[str] | list[int] | list[list[int]] -> a list of prompts."""
    if isinstance(prompts, str) or _is_token_ids(prompts):
        return [prompts]
    if isinstance(prompts, (list, tuple)) and prompts and all(isinstance(p, str) or _is_token_ids(p)
                                                                for p in prompts):
        return list(prompts)
    raise ValueError("prompts must be a string, a list of strings, a list of token ids or a list of "
                     f"token-id lists, got {type(prompts).__name__}"
                     + (" (empty)" if isinstance(prompts, (list, tuple)) and not prompts else ""))


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
                 on_output: Optional[Callable[[RequestOutput], None]] = None) -> list[RequestOutput]:
        """Runs every prompt to completion, batched; outputs in input order.
        ``on_output`` sees every intermediate output (for streaming)."""
        plist = normalize_prompts(prompts)
        return self._run(plist, normalize_params(params, len(plist)), on_output)

    def chat(self, messages, params=None,
             on_output: Optional[Callable[[RequestOutput], None]] = None) -> list[RequestOutput]:
        """One conversation ([{"role", "content"}, ...]) or a list of them,
        rendered with the model's chat template."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages or [])
        if not convs or not all(isinstance(c, (list, tuple)) and c for c in convs):
            raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts, or a list of them")
        tok = self.engine.tokenizer
        prompts = [tok.encode(tok.apply_chat_template(c, add_generation_prompt=True), add_special_tokens=False)
                   for c in convs]
        return self._run(prompts, normalize_params(params, len(prompts)), on_output)

    def _run(self, prompts: Sequence[Prompt], params: list[SamplingParams],
             on_output: Optional[Callable[[RequestOutput], None]]) -> list[RequestOutput]:
        engine = self.engine
        self._compile_constraints(params)
        ids = [f"llm-{next(self._ids)}" for _ in prompts]
        added: list[str] = []
        try:
            for rid, prompt, p in zip(ids, prompts, params):
                engine.add_request(rid, prompt, p)
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

