"""SamplingParams validation: every bad value raises ValueError naming its field."""

import pytest

from paged.core.engine.sampling_params import SamplingParams


@pytest.mark.parametrize("field,value", [
    ("n", 0), ("n", 1.5), ("temperature", -0.1), ("temperature", float("nan")), ("temperature", "hot"),
    ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2), ("top_k", 2.5), ("min_p", 1.1), ("min_p", -0.1),
    ("repetition_penalty", 0.0), ("presence_penalty", 2.5), ("frequency_penalty", -3),
    ("seed", 1.5), ("max_tokens", 0), ("max_tokens", -4), ("min_tokens", -1),
    ("stop", ""), ("stop", [""]), ("stop", 5), ("stop_token_ids", [-1]), ("stop_token_ids", "2"),
    ("logprobs", -1), ("logprobs", 21), ("prompt_logprobs", 100), ("ignore_eos", "yes"),
])
def test_invalid_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=3, min_tokens=4)


def test_normalisation_and_defaults():
    p = SamplingParams(stop="###", top_k=-1, temperature=0)
    assert p.stop_strings == ["###"] and p.top_k == 0 and p.greedy
    assert SamplingParams(stop=["a", "bc"]).stop_strings == ["a", "bc"]
    assert SamplingParams().stop_token_ids == [] and not SamplingParams().greedy


def test_vocab_check():
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[50000]).validate_for_vocab(49152)
    SamplingParams(stop_token_ids=[2]).validate_for_vocab(49152)


@pytest.mark.parametrize("field,value", [
    ("seed", 2**64), ("seed", -(2**63) - 1), ("seed", True), ("repetition_penalty", float("inf")),
    ("temperature", float("inf")), ("min_p", float("nan")), ("presence_penalty", float("-inf")),
    ("logit_bias", {1: 101}), ("logit_bias", {1: float("nan")}), ("logit_bias", {"1": 2.0}),
    ("logit_bias", {-1: 2.0}), ("logit_bias", [1, 2]),
])
def test_values_the_sampler_cannot_take_are_refused(field, value):
    with pytest.raises(ValueError, match=f"^{field}: expected .*, got "):
        SamplingParams(**{field: value})


def test_seed_edges_and_logit_bias_accepted():
    assert SamplingParams(seed=2**64 - 1).seed == 2**64 - 1
    assert SamplingParams(seed=-(2**63)).seed == -(2**63)
    assert SamplingParams(logit_bias={7: -100, 8: 100.0}).logit_bias == {7: -100.0, 8: 100.0}
    assert SamplingParams().logit_bias == {}


def test_logit_bias_vocab_check():
    with pytest.raises(ValueError, match="logit_bias: expected token ids < the vocabulary size 100, got 100"):
        SamplingParams(logit_bias={100: 1.0}).validate_for_vocab(100)
    SamplingParams(logit_bias={99: 1.0}).validate_for_vocab(100)
