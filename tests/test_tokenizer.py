"""Tokenizer vs HF transformers' tokenizer loaded from the same GGUF; chat
template; streaming detokenizer never emits broken UTF-8."""

from __future__ import annotations

import pytest

from paged.core.models.tokenizer import IncrementalDetokenizer

transformers = pytest.importorskip("transformers")

TEXTS = [
    "Hello world",
    "In 2024, 3.14159 and 1,000,000 people; 12345678901234567890",
    "  leading  spaces\n\n\ttabs and trailing   ",
    "def f(x):\n    return x**2  # square\n\nprint(f(3))",
    "héllo wörld — naïve café, Straße, ĳ",
    "日本語のテキスト 中文 한국어 العربية русский",
    "emoji 🎉🚀 👩‍👩‍👧 ✔️",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "It's we'll they've I'd YOU'RE",
    "x=1;y=2;print(x+y)//\\\\ {\"json\": [1, 2.5e-3, null]}",
    "a\r\nb\u00a0c\u2003d",
    "",
    "<|endoftext|>raw special in text<repo_name>",
]


@pytest.fixture(scope="module")
def ours(default_model_fp32):
    return default_model_fp32.tokenizer


@pytest.fixture(scope="module")
def hf_tok(default_model_path):
    return transformers.AutoTokenizer.from_pretrained(default_model_path.parent,
                                                      gguf_file=default_model_path.name)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_hf(ours, hf_tok, text):
    ids = ours.encode(text)
    assert ids == hf_tok.encode(text, add_special_tokens=True)
    assert ours.decode(ids, skip_special_tokens=False) == hf_tok.decode(ids, skip_special_tokens=False)
    assert ours.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True)


def test_default_model_special_tokens(ours):
    assert ours.eos_token_id == 2 and ours.eos_token == "<|im_end|>"
    assert ours.encode("hi")[0] != ours.bos_token_id  # no BOS added
    assert ours.encode("<|im_end|>") == [2]  # special tokens are not split
    assert ours.decode([2, ours.encode("ok")[0]]) == "ok"
    with pytest.raises(ValueError, match="token id 999999 is out of range"):
        ours.decode([999999])


def test_chat_template_matches_hf(ours, hf_tok):
    convs = [
        [{"role": "user", "content": "hi"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
         {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"}],
    ]
    for msgs in convs:
        for gen in (True, False):
            assert ours.apply_chat_template(msgs, add_generation_prompt=gen) == \
                hf_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)


def test_chat_template_errors(ours):
    with pytest.raises(ValueError, match=r"messages\[0\] must be a dict"):
        ours.apply_chat_template(["hello"])


def test_chat_template_is_sandboxed(default_model_fp32):
    from paged.core.models.tokenizer import Tokenizer

    evil = Tokenizer(default_model_fp32.tokenizer.backend, bos_token_id=None, eos_token_id=2,
                     chat_template="{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(Exception) as e:
        evil.apply_chat_template([{"role": "user", "content": "x"}])
    assert "unsafe" in str(e.value).lower() or "not safely" in str(e.value).lower()


@pytest.mark.parametrize("text", [TEXTS[5], TEXTS[6], TEXTS[4] + " " + TEXTS[3]])
def test_incremental_detokenizer(ours, text):
    prompt = ours.encode("<|im_start|>assistant\n")
    ids = ours.encode(text)
    detok = IncrementalDetokenizer(ours, prompt)
    pieces = [detok.add(i) for i in ids]
    assert all("\ufffd" not in p for p in pieces)  # never a broken character
    assert "".join(pieces) + detok.flush() == ours.decode(ids)
    assert detok.text == ours.decode(ids)
    # multi-byte characters really did span tokens, so something was held back
    if any(ord(ch) > 0x7FF for ch in text):
        assert "" in pieces
