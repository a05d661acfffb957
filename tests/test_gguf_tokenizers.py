"""GGUF tokenizers the families need, on small generated vocabularies.

- SentencePiece (``tokenizer.ggml.model = llama``: Gemma, Phi-3): paged's
  encoding against a transcription of llama.cpp's (llm_tokenizer_spm: the
  highest-scoring adjacent pair merged first, the leftmost on ties; bytes of
  characters without a piece as <0xXX>; a space before the text and after
  every special token with add_space_prefix), on random text with special
  tokens, newlines and characters outside the vocabulary; decoding gives the
  text back.
- gpt-4o (Phi-4-mini): the pre-tokenizer's pieces are the o200k regex's
  (the ``regex`` module's matches), and a GGUF byte-level vocabulary with
  that ``tokenizer.ggml.pre`` round-trips.
- stop tokens: EOS, eot/eom ids and end-of-turn control tokens.
"""

from __future__ import annotations

import heapq
import random

import pytest

from paged.core.models.loaders.gguf_loader import gguf_stop_tokens
from paged.core.models.tokenizer import Tokenizer

SPACE = "\u2581"
CORPUS = ("the quick brown fox jumps over the lazy dog; hello world, hello there. it is what it is! "
          "translate this text into another language and then back again\nthe end")


def spm_meta(add_space_prefix: bool, seed: int = 0) -> dict:
    """A SentencePiece vocabulary mined from CORPUS: control tokens, 256
    byte tokens, the characters, and the most frequent substrings of its
    words (distinct scores, longer and more frequent pieces higher)."""
    rng = random.Random(seed)
    text = CORPUS.replace(" ", SPACE)
    counts: dict[str, int] = {}
    for word in text.replace("\n", " ").split(" "):
        for w in (word, SPACE + word.lstrip(SPACE)):
            for i in range(len(w)):
                for j in range(i + 2, min(len(w), i + 6) + 1):
                    counts[w[i:j]] = counts.get(w[i:j], 0) + 1
    pieces = sorted(counts, key=lambda p: (-counts[p] * len(p), p))[:150]
    specials = ["<unk>", "<s>", "</s>", "<start_of_turn>", "<end_of_turn>"]
    chars = sorted(set(text) - {"\n"})  # no piece for "\n" nor for "é": bytes
    tokens = specials + [f"<0x{b:02X}>" for b in range(256)] + chars + pieces + ["<|tool|>"]
    types = [2, 3, 3, 3, 3] + [6] * 256 + [1] * (len(chars) + len(pieces)) + [4]
    scores = [0.0] * 261 + [-1000.0 - i for i in range(len(chars))]
    scores += [-float(i) - rng.random() * 0.5 for i in range(len(pieces))] + [0.0]
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": scores,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
            "tokenizer.ggml.unknown_token_id": 0, "tokenizer.ggml.add_space_prefix": add_space_prefix,
            "tokenizer.ggml.add_bos_token": False}


def llama_cpp_spm(meta: dict, text: str) -> list[int]:
    """llama.cpp's SentencePiece tokenization (llama-vocab.cpp), transcribed."""
    tokens, scores, types = (meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.scores"],
                             meta["tokenizer.ggml.token_type"])
    vocab = {t: i for i, t in enumerate(tokens)}
    specials = sorted((t for t, k in zip(tokens, types) if k in (3, 4)), key=len, reverse=True)
    out, prev_special, pos = [], True, 0
    while pos <= len(text):
        nxt = min(((text.find(s, pos), -len(s), s) for s in specials if text.find(s, pos) >= 0),
                  default=(len(text), 0, None))
        raw = text[pos:nxt[0]]
        if raw:
            if meta["tokenizer.ggml.add_space_prefix"] and prev_special:
                raw = " " + raw
            out += _spm_session(raw.replace(" ", SPACE), vocab, scores)
            prev_special = False
        if nxt[2] is None:
            break
        out.append(vocab[nxt[2]])
        prev_special = True
        pos = nxt[0] + len(nxt[2])
    return out


def _spm_session(text: str, vocab: dict, scores: list[float]) -> list[int]:
    syms = list(text)
    alive = [True] * len(syms)
    queue: list = []

    def push(i: int) -> None:
        j = next((k for k in range(i + 1, len(syms)) if alive[k]), None)
        if j is not None and syms[i] + syms[j] in vocab:
            heapq.heappush(queue, (-scores[vocab[syms[i] + syms[j]]], i, syms[i], syms[j]))

    for i in range(len(syms) - 1):
        push(i)
    while queue:
        _, i, left, right = heapq.heappop(queue)
        j = next((k for k in range(i + 1, len(syms)) if alive[k]), None)
        if not alive[i] or j is None or syms[i] != left or syms[j] != right:
            continue  # stale
        syms[i], alive[j] = left + right, False
        prev = next((k for k in range(i - 1, -1, -1) if alive[k]), None)
        if prev is not None:
            push(prev)
        push(i)
    out = []
    for s, a in zip(syms, alive):
        if a:
            out += [vocab[s]] if s in vocab else [vocab[f"<0x{b:02X}>"] for b in s.encode("utf-8")]
    return out


def random_texts(seed: int, n: int = 300) -> list[str]:
    rng = random.Random(seed)
    words = CORPUS.replace("\n", " \n ").split(" ") + ["é", "naïve", "x", "  ", "<start_of_turn>", "<end_of_turn>",
                                                       "<|tool|>", "\n\n", "zzz", "ü2"]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(1, 14))) for _ in range(n)] + [
        "", " ", "hello", " hello", "<start_of_turn>user\nhello world<end_of_turn>\n", "hello<|tool|>world"]


@pytest.mark.parametrize("add_space_prefix", [False, True], ids=["gemma", "phi3"])
def test_sentencepiece_encodes_as_llama_cpp(add_space_prefix):
    meta = spm_meta(add_space_prefix)
    tok = Tokenizer.from_gguf_metadata(meta)
    assert tok.add_bos_token is False
    for text in random_texts(1):
        want = llama_cpp_spm(meta, text)
        assert tok.encode(text) == want, repr(text)
        # decoding gives the text back (the prefix space dropped, as llama.cpp and HF do)
        assert tok.decode(want, skip_special_tokens=False) == text or add_space_prefix, repr(text)


def test_sentencepiece_bos_and_decode():
    meta = spm_meta(True)
    del meta["tokenizer.ggml.add_bos_token"]
    tok = Tokenizer.from_gguf_metadata(meta)
    ids = tok.encode("hello world")
    assert ids[0] == 1 and tok.add_bos_token  # llama.cpp's default for SentencePiece: BOS added
    assert tok.decode(ids) == "hello world"
    assert tok.decode(tok.encode("naïve é\n")) == "naïve é\n"  # byte fallback both ways


def test_sentencepiece_needs_scores():
    meta = spm_meta(False)
    meta["tokenizer.ggml.scores"] = meta["tokenizer.ggml.scores"][:-1]
    with pytest.raises(ValueError, match=r"tokenizer.ggml.scores: expected \d+ scores \(one per token\), got \d+"):
        Tokenizer.from_gguf_metadata(meta)


def test_unknown_tokenizer_model_is_named():
    with pytest.raises(ValueError, match=r"tokenizer.ggml.model: expected 'gpt2' or 'llama'.*got 't5'"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "t5", "tokenizer.ggml.tokens": ["a"]})


GPT4O_TEXTS = ["Hello World, it's HTTPServer's day!", "I'M here; they'VE gone", "1234567 numbers 12",
               "  spaces\n\n\tand\r\nbreaks ", "naïve ÜBER straße", "a/b//c\n/", "emoji 😀 and 中文字符", "x'S y'll"]


def test_gpt4o_pre_tokenizer_is_the_o200k_regex():
    regex = pytest.importorskip("regex")
    from paged.core.models.tokenizer import PRE_TOKENIZER_REGEXES

    (pattern,) = PRE_TOKENIZER_REGEXES["gpt-4o"]
    tok = _gpt2_tokenizer("gpt-4o")
    for text in GPT4O_TEXTS:
        pieces = [p for p, _ in tok.backend.pre_tokenizer.pre_tokenize_str(text)]
        want = ["".join(BYTES[b] for b in m.encode("utf-8")) for m in regex.findall(pattern, text)]
        assert pieces == want, text
        assert tok.decode(tok.encode(text)) == text


def _gpt2_tokenizer(pre: str) -> Tokenizer:
    symbols = sorted(set(BYTES.values()))
    return Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre,
                                         "tokenizer.ggml.tokens": symbols, "tokenizer.ggml.merges": [],
                                         "tokenizer.ggml.token_type": [1] * len(symbols)})


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> symbol table."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


BYTES = _bytes_to_unicode()


def test_stop_tokens_from_gguf():
    tokens = ["<pad>", "<eos>", "<bos>", "<end_of_turn>", "<|end|>", "<|endoftext|>", "a"]
    meta = {"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": [3, 3, 3, 3, 1, 3, 1]}
    assert gguf_stop_tokens(meta, 1) == [1, 3]  # <|end|> is no control token here; <|endoftext|> ends no turn
    meta["tokenizer.ggml.eot_token_id"] = 6
    assert gguf_stop_tokens(meta, 1) == [1, 6, 3]
    assert gguf_stop_tokens({}, None) == []
