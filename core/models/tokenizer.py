"""Tokenizer: encode/decode, special tokens, chat template, streaming detokenizer.

Built from GGUF metadata or from a Hugging Face ``tokenizer.json`` (+
tokenizer_config.json), on the ``tokenizers`` library. GGUF vocabularies of
two kinds, encoded as llama.cpp encodes them:

- byte-level BPE (``tokenizer.ggml.model = gpt2``), pre-tokenised with
  llama.cpp's regexes for the file's ``tokenizer.ggml.pre`` (smollm, llama3,
  qwen2, gpt-4o for Phi-4-mini, ...);
- SentencePiece (``tokenizer.ggml.model = llama``: Gemma, Phi-3, Llama 2):
  BPE over the pieces, merging the pair whose merged piece scores highest
  first (merges derived from the scores), bytes of characters without a
  piece as <0xXX> tokens, spaces as U+2581 and, with
  ``tokenizer.ggml.add_space_prefix`` (default on), a space before the text
  and after every special token, as llama.cpp does.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Iterable, Sequence

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as _Backend

logger = logging.getLogger("paged")

# Pre-tokenizer regexes of llama.cpp (llama-vocab.cpp), keyed by tokenizer.ggml.pre.
# Each list is applied in order; every regex splits the pieces of the previous one.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
           r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
          r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# o200k (tiktoken's, in the tokenizer.json of Phi-4-mini; llama.cpp's "gpt-4o")
_GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
          r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
          r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZER_REGEXES: dict[str, list[str]] = {
    "default": [_GPT2],
    "gpt-2": [_GPT2],
    "phi-2": [_GPT2],
    "smollm": [r"\p{N}", _GPT2],
    "starcoder": [r"\p{N}", _GPT2],
    "refact": [r"\p{N}", _GPT2],
    "codeshell": [r"\p{N}", _GPT2],
    "llama-bpe": [_LLAMA3],
    "llama3": [_LLAMA3],
    "smaug-bpe": [_LLAMA3],
    "qwen2": [_QWEN2],
    "deepseek-r1-qwen": [_QWEN2],
    "gpt-4o": [_GPT4O],
}

_TOKEN_TYPE_NORMAL = 1
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4
#: SentencePiece's whitespace: spaces are this character in the pieces
SPM_SPACE = "\u2581"


class TokenizerError(ValueError):
    pass


class Tokenizer:
    """A ``tokenizers.Tokenizer`` plus the model's special-token conventions."""

    def __init__(self, backend: _Backend, *, bos_token_id: int | None, eos_token_id: int | None,
                 add_bos_token: bool = False, chat_template: str | None = None):
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        #: prepend BOS by hand (GGUF); HF tokenizer.json post-processors add it themselves
        self.add_bos_token = add_bos_token
        self.chat_template = chat_template
        self._template = None
        self._longest: int | None = None

    # -- construction ---------------------------------------------------------
    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any], source: Path | str = "<gguf>") -> "Tokenizer":
        kind = meta.get("tokenizer.ggml.model")
        tokens = meta.get("tokenizer.ggml.tokens")
        if kind not in GGUF_TOKENIZER_MODELS:
            raise _load_error(source, f"tokenizer.ggml.model: expected {' or '.join(map(repr, GGUF_TOKENIZER_MODELS))} "
                                      f"(byte-level BPE, SentencePiece), got {kind!r}; load the HF folder instead")
        if not tokens:
            raise _load_error(source, "GGUF file has no tokenizer.ggml.tokens")
        types = meta.get("tokenizer.ggml.token_type") or []
        backend = (_bpe_backend(meta, tokens, source) if kind == "gpt2" else
                   _spm_backend(meta, tokens, types, source))
        backend.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                                    for i, t in enumerate(types) if t == _TOKEN_TYPE_CONTROL])
        backend.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                            for i, t in enumerate(types) if t == _TOKEN_TYPE_USER_DEFINED])
        return cls(backend,
                   bos_token_id=_opt_int(meta.get("tokenizer.ggml.bos_token_id")),
                   eos_token_id=_opt_int(meta.get("tokenizer.ggml.eos_token_id")),
                   # llama.cpp's default: a SentencePiece vocabulary adds BOS, a BPE one does not
                   add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", kind == "llama")),
                   chat_template=meta.get("tokenizer.chat_template"))

    @classmethod
    def from_hf_folder(cls, folder: Path | str) -> "Tokenizer":
        folder = Path(folder)
        tok_file = folder / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(f"{tok_file}: no tokenizer.json in the model folder")
        try:
            backend = _Backend.from_file(str(tok_file))
        except Exception as e:
            raise _load_error(tok_file, f"cannot parse tokenizer ({e})") from e
        cfg = _read_json(folder / "tokenizer_config.json")
        template = cfg.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        jinja_file = folder / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text(encoding="utf-8")
        gen = _read_json(folder / "generation_config.json")
        model_cfg = _read_json(folder / "config.json")

        def special_id(name: str) -> int | None:
            tok = cfg.get(name)
            if isinstance(tok, dict):
                tok = tok.get("content")
            if isinstance(tok, str):
                return backend.token_to_id(tok)
            value = gen.get(f"{name}_id", model_cfg.get(f"{name}_id"))
            return value[0] if isinstance(value, list) and value else value

        return cls(backend, bos_token_id=special_id("bos_token"),
                   eos_token_id=special_id("eos_token"), add_bos_token=False,
                   chat_template=template)

    # -- encode / decode --------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"encode() expects a str, got {type(text).__name__}")
        # encode_batch releases the GIL (encode holds it: a 7 MB prompt froze
        # the server's event loop for seconds even from a worker thread)
        ids = self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None \
                and (not ids or ids[0] != self.bos_token_id):
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        ids = list(ids)
        vocab = self.vocab_size
        for i in ids:
            if not 0 <= int(i) < vocab:
                raise ValueError(f"token id {i} is out of range for a vocabulary of {vocab}")
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def longest_token_chars(self) -> int:
        """The most characters one token decodes to: n tokens of text are at
        most n times this many characters (the server's prompt-length cap)."""
        if self._longest is None:
            self._longest = max(len(self.backend.decode([i], skip_special_tokens=False))
                                for i in range(self.vocab_size))
        return self._longest

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    @property
    def bos_token(self) -> str | None:
        return None if self.bos_token_id is None else self.backend.id_to_token(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        return None if self.eos_token_id is None else self.backend.id_to_token(self.eos_token_id)

    # -- chat -------------------------------------------------------------------
    def apply_chat_template(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        """Render ``messages`` ([{"role": ..., "content": ...}]) with the model's
        template in a sandboxed jinja2 environment (as HF transformers does)."""
        if not self.chat_template:
            raise ValueError("this model has no chat template; send a plain prompt instead")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m:
                raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content', got {m!r}")
        if self._template is None:
            self._template = _compile_template(self.chat_template)
        import jinja2

        try:
            return self._template.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token or "", eos_token=self.eos_token or "",
                                         **kwargs)
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template failed: {e}") from e


#: GGUF tokenizer.ggml.model values paged reads: byte-level BPE, SentencePiece
GGUF_TOKENIZER_MODELS = ("gpt2", "llama")


def _bpe_backend(meta: dict[str, Any], tokens: list[str], source) -> _Backend:
    """Byte-level BPE with llama.cpp's pre-tokenizer for ``tokenizer.ggml.pre``."""
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZER_REGEXES:
        logger.warning("%s: unknown tokenizer.ggml.pre %r; using the GPT-2 split", source, pre)
    regexes = PRE_TOKENIZER_REGEXES.get(pre, [_GPT2])
    backend = _Backend(models.BPE(vocab, merges, ignore_merges=regexes[0] is _LLAMA3))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    return backend


def spm_merges(tokens: list[str], scores: list[float], mergeable: list[bool]) -> list[tuple[str, str]]:
    """BPE merges that reproduce SentencePiece's (and llama.cpp's) greedy
    encoding: every split of a mergeable piece into two pieces of the
    vocabulary, ordered by the merged piece's score, highest first (ties:
    the longer left part first, as transformers' generate_merges orders them)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = []
    for i, piece in enumerate(tokens):
        if not mergeable[i] or len(piece) < 2:
            continue
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            if left in vocab and right in vocab:
                merges.append((scores[i], len(left), len(right), -vocab[left], left, right))
    merges.sort(key=lambda m: m[:4], reverse=True)
    return [(m[4], m[5]) for m in merges]


def _spm_backend(meta: dict[str, Any], tokens: list[str], types: list[int], source) -> _Backend:
    """SentencePiece pieces as BPE with byte fallback (see the module docstring)."""
    scores = meta.get("tokenizer.ggml.scores")
    if not scores or len(scores) != len(tokens):
        raise _load_error(source, f"tokenizer.ggml.scores: expected {len(tokens)} scores (one per token), "
                                  f"got {len(scores or [])}")
    types = list(types) or [_TOKEN_TYPE_NORMAL] * len(tokens)
    unk = _opt_int(meta.get("tokenizer.ggml.unknown_token_id"))
    vocab = {tok: i for i, tok in enumerate(tokens)}
    merges = spm_merges(tokens, [float(x) for x in scores], [t == _TOKEN_TYPE_NORMAL for t in types])
    backend = _Backend(models.BPE(vocab, merges, unk_token=None if unk is None else tokens[unk],
                                  fuse_unk=True, byte_fallback=True))
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    # the normalizer runs on each stretch of text between added tokens: the
    # space goes before every one, even one that starts with a space, as in llama.cpp
    steps = [normalizers.Prepend(SPM_SPACE)] if prefix else []
    backend.normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", SPM_SPACE)])
    steps = [decoders.Replace(SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return backend


class IncrementalDetokenizer:
    """Streams text for generated tokens; never emits a broken UTF-8 sequence.

    A few prompt tokens are kept as context so word-boundary spaces decode as
    they would in the full text. Text is held back while the decoded tail ends
    in U+FFFD (an incomplete multi-byte character).
    """

    _CONTEXT = 5

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._ids = list(prompt_ids[-self._CONTEXT:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text = ""  # everything emitted so far

    def _decode(self, start: int, end: int | None = None) -> str:
        return self.tokenizer.decode(self._ids[start:end], skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Append one token; return the newly completed text (maybe "")."""
        self._ids.append(int(token_id))
        prefix = self._decode(self._prefix_offset, self._read_offset)
        full = self._decode(self._prefix_offset)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        delta = full[len(prefix):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end of a stream: whatever is still held back (may contain U+FFFD)."""
        prefix = self._decode(self._prefix_offset, self._read_offset)
        full = self._decode(self._prefix_offset)
        delta = full[len(prefix):] if len(full) > len(prefix) else ""
        self._prefix_offset = self._read_offset = len(self._ids)
        self.text += delta
        return delta


def _compile_template(source: str):
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise jinja2.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda v, indent=None: json.dumps(v, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"invalid chat template: {e}") from e


def _read_json(path: Path) -> dict:
    from paged.core.models.loaders import read_json

    return read_json(path, required=False)


def _opt_int(v) -> int | None:
    return None if v is None else int(v)


def _load_error(path, problem: str) -> Exception:
    from paged.core.models.loaders import ModelLoadError

    return ModelLoadError(path, problem)
