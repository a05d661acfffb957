"""vLLM's prompt forms in the offline API (core/entrypoints/prompts.py):
TextPrompt / TokensPrompt dicts and lists of them, mixed with strings and
token ids, in LLM.generate; conversations in LLM.chat; one-line errors
(`name: expected X, got Y`) for anything else.

Oracles: the same prompts given as plain strings / token-id lists (greedy,
so equal tokens), the tokenizer's own ids, vLLM's documented TypedDicts.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from paged.core.engine.config import EngineConfig
from paged.core.engine.engine import Engine
from paged.core.engine.sampling_params import SamplingParams
from paged.core.entrypoints.llm import LLM
from paged.core.entrypoints.prompts import conversations_of, prompts_of

GREEDY = SamplingParams(temperature=0.0, max_tokens=6)


@pytest.fixture(scope="module")
def llm(default_model_path):
    engine = Engine(EngineConfig(model=str(default_model_path), device="cpu", dtype="float32", max_model_len=256,
                                 max_num_seqs=8, kv_cache_memory="64MiB", block_size=16,
                                 cpu_threads_bind=str(min(os.sched_getaffinity(0)))))
    return LLM.from_engine(engine)


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_dict_prompts_equal_their_plain_forms(llm):
    ids = llm.get_tokenizer().encode("The capital of France is")
    plain = llm.generate(["Hello there", ids, "One, two,", [1, 2, 3]], GREEDY)
    mixed = llm.generate([{"prompt": "Hello there"}, {"prompt_token_ids": ids},
                          "One, two,", np.array([1, 2, 3]).tolist()], sampling_params=GREEDY)
    assert tokens(mixed) == tokens(plain)
    assert mixed[1].prompt_token_ids == ids and mixed[0].prompt == "Hello there"
    # one dict alone, a TokensPrompt carrying its text, ids as a tuple and numpy ints
    assert tokens(llm.generate({"prompt": "Hello there"}, GREEDY)) == tokens(plain[:1])
    assert tokens(llm.generate({"prompt_token_ids": ids, "prompt": "The capital of France is"}, GREEDY)) == \
        tokens(plain[1:2])
    assert tokens(llm.generate([tuple(ids)], GREEDY)) == tokens(llm.generate([list(np.array(ids))], GREEDY)) == \
        tokens(plain[1:2])
    # vLLM's own TypedDicts are plain dicts at run time: the same shapes
    assert prompts_of([{"prompt": "a"}, {"prompt_token_ids": [5]}]) == ["a", [5]]


def test_chat_takes_one_conversation_or_several_and_text_parts(llm):
    conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi."}]
    parts = [conv[0], {"role": "user", "content": [{"type": "text", "text": "Say "}, {"type": "text", "text": "hi."}]}]
    one = llm.chat(conv, GREEDY)
    assert tokens(llm.chat(parts, sampling_params=GREEDY)) == tokens(one)
    assert tokens(llm.chat([conv, parts], GREEDY)) == tokens(one) * 2


VOCAB = 49152
BAD_PROMPTS = [
    (5, "prompts: expected a string, a list of token ids, {\"prompt\": str} or {\"prompt_token_ids\": [int, ...]}, "
        "or a list of them, got int 5"),
    ([], "prompts: expected at least one prompt, got an empty list"),
    ([1, "a"], "prompts: expected token ids (all ints) or a list of prompts, got ints mixed with str at [1]"),
    (["a", 2.5], "prompts[1]: expected a string, a list of token ids, {\"prompt\": str} or "
                 "{\"prompt_token_ids\": [int, ...]}, got float 2.5"),
    (["a", None], "prompts[1]: expected a string, a list of token ids, {\"prompt\": str} or "
                  "{\"prompt_token_ids\": [int, ...]}, got None"),
    ([[1, 2], []], "prompts[1]: expected a non-empty list of token ids, got an empty list"),
    ([[1, True]], "prompts[0][1]: expected a token id (an int), got True"),
    ([1, VOCAB], f"prompts[1]: expected a token id in [0, {VOCAB}), got {VOCAB}"),
    ({"prompt": 3}, 'prompts["prompt"]: expected a string, got int 3'),
    ([{"prompt_token_ids": [1, -1]}], f'prompts[0]["prompt_token_ids"][1]: expected a token id in [0, {VOCAB}), '
                                      "got -1"),
    ([{"prompt_token_ids": "1 2"}], 'prompts[0]["prompt_token_ids"]: expected a non-empty list of token ids, '
                                    "got str '1 2'"),
    ([{}], 'prompts[0]: expected a dict with "prompt" (text) or "prompt_token_ids", got an empty dict'),
    ([{"text": "a"}], 'prompts[0]: expected a dict with the keys "prompt" or "prompt_token_ids", '
                      "got the key 'text'"),
    ({"prompt": "a", "multi_modal_data": {"image": 1}},
     'prompts["multi_modal_data"]: expected absent (paged serves text-only models), got {\'image\': 1}'),
    ([{"prompt_embeds": [[0.1]]}], 'prompts[0]["prompt_embeds"]: expected absent (prompt embeddings are not '
                                   "supported: give text or token ids), got [[0.1]]"),
]


@pytest.mark.parametrize("prompts,message", BAD_PROMPTS, ids=[m.partition(":")[0] + f"-{i}"
                                                             for i, (_, m) in enumerate(BAD_PROMPTS)])
def test_bad_prompts_are_one_line(llm, prompts, message):
    assert llm.engine.model_config.vocab_size == VOCAB
    with pytest.raises(ValueError) as info:
        llm.generate(prompts, GREEDY)
    assert str(info.value) == message
    assert not llm.engine.has_unfinished_requests()


def test_engine_refusals_name_the_prompt(llm):
    with pytest.raises(ValueError, match=r"^prompts\[1\]: prompt has 300 tokens; max_model_len is 256"):
        llm.generate(["fine", [1] * 300], GREEDY)
    assert not llm.engine.has_unfinished_requests()  # the first one was taken back
    with pytest.raises(ValueError, match=r"^sampling_params: expected it or params, not both, got both$"):
        llm.generate("a", GREEDY, sampling_params=GREEDY)


BAD_MESSAGES = [
    ("hi", "messages: expected a list of {\"role\", \"content\"} messages, or a list of such lists, got str 'hi'"),
    ([], "messages: expected a list of {\"role\", \"content\"} messages, or a list of such lists, got an empty list"),
    ([{"content": "hi"}], 'messages[0]["role"]: expected one of system, user, assistant, tool, developer, got None'),
    ([{"role": "user", "content": 5}], 'messages[0]["content"]: expected a string or a list of {"type": "text", '
                                       '"text": ...} parts, got int 5'),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
     'messages[0]["content"][0]["type"]: expected "text" (paged serves text-only models), got \'image_url\''),
    ([[{"role": "user", "content": "a"}], "b"], 'messages[1]: expected a conversation: a non-empty list of '
                                                '{"role", "content"} messages, got str \'b\''),
]


@pytest.mark.parametrize("messages,message", BAD_MESSAGES)
def test_bad_messages_are_one_line(messages, message):
    with pytest.raises(ValueError) as info:
        conversations_of(messages)
    assert str(info.value) == message
