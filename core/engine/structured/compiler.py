"""Compiles structured-output constraints with llguidance, once per distinct one.

    compiler = GrammarCompiler(tokenizer, vocab_size=49152, eos_token_ids=[2])
    template = compiler.compile(StructuredOutputsParams(json=schema))   # blocking; GrammarError if bad
    future = compiler.submit(params)             # the same on the compile thread (a done future when cached)
    matcher = template.deep_copy()               # one per sequence: ~10 us

A compiled constraint is an llguidance LLMatcher in its start state, kept as a
template in an LRU cache keyed by the constraint's text; every sequence gets
a deep copy. Building the matcher is the expensive part (about 1-5 ms for a
small schema here, up to a second for a huge one; llguidance releases the
GIL meanwhile), so it runs on its own thread for requests the engine admits
and never inside an engine step. Failures are cached too: a client retrying
a bad schema costs one dictionary lookup.

One client cannot stall the others: a constraint's text is held to
MAX_CONSTRAINT_BYTES (a schema of thousands of patterns costs seconds and,
larger, trips llguidance's internal limits), and constraints over
LARGE_CONSTRAINT_BYTES compile on a lane of their own, so they queue behind
each other, never in front of the small ones most requests carry.

A constraint that admits no output at all (a `$ref` cycle, `{"$ref": "#"}`,
`root ::= root`) compiles in llguidance but allows no first token; it is
found here by computing the start state's mask once, and refused.

The llguidance tokenizer is built from paged's own tokenizer (its HF
`tokenizers` JSON) on first use, ~0.5 s, and shared by every matcher.

JSON is generated without free whitespace: ", " between items and ": " after
keys, like json.dumps (params.JSON_LAYOUT). A model allowed free whitespace
can spend its whole max_tokens on newlines.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Optional, Union

import llguidance

from paged.core.argcheck import message
from paged.core.argcheck import short_repr

from paged.core.engine.structured.params import JSON_LAYOUT, StructuredOutputsParams

#: distinct compiled constraints kept (a template is a few KB to a few MB)
CACHE_SIZE = 256
#: the most bytes of constraint text (a schema's JSON) compiled: ~1 s of
#: compiling at worst here (2150 string patterns; 6000 take 6.7 s)
MAX_CONSTRAINT_BYTES = 128 * 2**10
#: constraints larger than this compile on the large lane
LARGE_CONSTRAINT_BYTES = 8 * 2**10


class GrammarError(ValueError):
    """A constraint that does not compile, or that the model's vocabulary
    cannot continue (found while generating: a byte no token holds). The
    request's fault either way: one line, the server's 400."""


class GrammarCompiler:
    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int], cache_size: int = CACHE_SIZE):
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._ll_tokenizer: Optional[llguidance.LLTokenizer] = None
        self._unwritable: Optional[frozenset[int]] = None
        self._cache: OrderedDict[tuple, Union[llguidance.LLMatcher, GrammarError]] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()  # the cache and the tokenizer: engine, server and compile threads
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="paged-grammar")
        self._large_pool = ThreadPoolExecutor(1, thread_name_prefix="paged-grammar-large")

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def pool(self) -> ThreadPoolExecutor:
        """The compile thread of small constraints (one per lane: compilations
        queue rather than crowd the engine's cores)."""
        return self._pool

    # -- compiling ---------------------------------------------------------------
    def cached(self, params: StructuredOutputsParams) -> Optional[llguidance.LLMatcher]:
        """The template when it is compiled already; raises its GrammarError
        when it failed before; None when it was never compiled."""
        with self._lock:
            hit = self._cache.get(params.key())
            if hit is not None:
                self._cache.move_to_end(params.key())
        if isinstance(hit, GrammarError):
            raise hit
        return hit

    def compile(self, params: StructuredOutputsParams, param: str = "structured_outputs") -> llguidance.LLMatcher:
        """The template matcher for `params` (compiled now unless cached).
        `param` names the request field in a GrammarError."""
        hit = self.cached(params)
        if hit is not None:
            return hit
        try:
            result: Union[llguidance.LLMatcher, GrammarError] = self._build(params, param)
        except GrammarError as exc:
            result = exc
        with self._lock:
            self._cache[params.key()] = result
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        if isinstance(result, GrammarError):
            raise result
        return result

    def submit(self, params: StructuredOutputsParams, param: str = "structured_outputs") -> Future:
        """compile() on the compile thread; already done when cached."""
        try:
            hit = self.cached(params)
        except GrammarError as exc:
            hit = exc
        if hit is None:
            if len(params.key()[1]) <= MAX_CONSTRAINT_BYTES:
                return self.lane_for(params).submit(self.compile, params, param)
            try:  # refused by its size at once: it waits behind no other compilation
                hit = self.compile(params, param)
            except GrammarError as exc:
                hit = exc
        done: Future = Future()
        if isinstance(hit, GrammarError):
            done.set_exception(hit)
        else:
            done.set_result(hit)
        return done

    def lane_for(self, params: StructuredOutputsParams) -> ThreadPoolExecutor:
        """The thread `params` compiles on: large constraints queue on their own."""
        return self._large_pool if len(params.key()[1]) > LARGE_CONSTRAINT_BYTES else self._pool

    def _build(self, params: StructuredOutputsParams, param: str) -> llguidance.LLMatcher:
        size = len(params.key()[1].encode("utf-8", "surrogatepass"))
        if size > MAX_CONSTRAINT_BYTES:
            raise GrammarError(message(param, f"a {params.describe()} of at most {MAX_CONSTRAINT_BYTES} bytes "
                                              "(its JSON text)", f"{size} bytes"))
        if params.kind == "choice":
            self._check_writable(params.choice, f"{param}.choice" if param == "structured_outputs" else param)
        grammar = self._grammar_text(params, param)
        limits = llguidance.LLParserLimits(verbose_errors=False)
        matcher = llguidance.LLMatcher(self.ll_tokenizer(), grammar, log_level=0, limits=limits)
        if matcher.is_error():
            raise _grammar_error(params, param, matcher.get_error())
        probe = matcher.deep_copy()
        probe.compute_bitmask()
        if probe.is_error():  # no first token allowed, and nothing to stop on
            raise GrammarError(message(param, f"a {params.describe()} that some output satisfies",
                                       short_repr(params.value, 60)) +
                               ", which admits none (a rule or $ref that only refers to itself?)")
        return matcher

    @staticmethod
    def _grammar_text(params: StructuredOutputsParams, param: str) -> str:
        kind, value = params.kind, params.value
        try:
            if kind in ("json", "json_object"):
                schema = {"type": "object"} if kind == "json_object" else value
                return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_LAYOUT)
            if kind == "regex":
                return llguidance.LLMatcher.grammar_from_regex(value)
            if kind == "choice":
                return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in value))
            return llguidance.grammar_from("grammar", value)  # Lark as is; GBNF converted to Lark
        except ValueError as exc:  # a JSON value llguidance cannot read, a GBNF that does not convert
            raise _grammar_error(params, param, str(exc)) from None

    def _check_writable(self, texts: list[str], param: str) -> None:
        """Choices with a byte no token holds can never be written (a
        vocabulary may lack rare lead bytes such as 0xF1): a clear error now,
        not a failure halfway through the output."""
        for text in texts:
            bad = sorted(set(text.encode("utf-8", "surrogatepass")) & self.unwritable_bytes())
            if bad:
                raise GrammarError(f"{param}: expected strings this model's vocabulary can write, got "
                                   f"{short_repr(text, 40)}, which needs byte 0x{bad[0]:02X} (no token holds it)")

    def unwritable_bytes(self) -> frozenset[int]:
        """The byte values that no token of the vocabulary contains."""
        if self._unwritable is None:
            lt, seen = self.ll_tokenizer(), set()
            for token in range(self._vocab_size):
                if not lt.is_special_token(token):
                    seen.update(lt.decode_bytes([token]))
            self._unwritable = frozenset(set(range(256)) - seen)
        return self._unwritable

    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's view of the vocabulary (built once, ~0.5 s, outside
        the lock: a cache lookup on the server's event loop never waits for it)."""
        if self._ll_tokenizer is None:
            built = llguidance.LLTokenizer(self._tokenizer.backend.to_str(), n_vocab=self._vocab_size,
                                           eos_token=self._eos)
            with self._lock:
                if self._ll_tokenizer is None:
                    self._ll_tokenizer = built
        return self._ll_tokenizer

    def close(self) -> None:
        for lane in (self._pool, self._large_pool):
            lane.shutdown(wait=False, cancel_futures=True)


_WHAT = {"json": "a JSON schema llguidance can compile", "json_object": "a JSON object",
         "regex": "a regular expression that compiles (Rust syntax, no look-around)",
         "choice": "a list of strings", "grammar": "a Lark or GBNF grammar that compiles"}


def _grammar_error(params: StructuredOutputsParams, param: str, why: str) -> GrammarError:
    return GrammarError(message(param, _WHAT[params.kind], short_repr(params.value, 60)) + ", "
                        f"which fails: {_one_line(why)}")


#: what a panic inside llguidance says instead of its assertion text
INTERNAL_LIMIT = "it is too large or too complex for llguidance (an internal limit was hit)"


def _one_line(message: str, limit: int = 300) -> str:
    """llguidance's messages span lines (a caret under the regex); keep the
    line that names the problem. A panic's text names llguidance's internals
    (`assertion failed: grammar.symbols.len() < ...`), nothing a client can act on."""
    if message.lstrip().lower().startswith("panic") or "panicked at" in message:
        return INTERNAL_LIMIT
    lines = [ln.strip() for ln in message.strip().splitlines() if ln.strip()]
    named = next((ln for ln in lines if ln.startswith("error:")), None)
    text = named.removeprefix("error:").strip() if named else (lines[0] if lines else "unknown error")
    return text if len(text) <= limit else text[: limit - 3] + "..."
