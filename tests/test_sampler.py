"""Sampler against straightforward torch reference computations."""

import math

import pytest
import torch

from paged.core.engine.request import Request
from paged.core.engine.sampler import Sampler
from paged.core.engine.sampling_params import SamplingParams, StructuredOutputsParams

V = 12
EOS = 3


def seq(params, prompt=(1, 2), output=()):
    s = Request("r", None, list(prompt), params).seqs[0]
    s.token_ids.extend(output)
    return s


def ref_filtered_probs(logits, p: SamplingParams):
    """Plain per-row reference: temperature, top_k, top_p, min_p -> probabilities."""
    x = logits / p.temperature
    probs = torch.softmax(x, -1)
    order = torch.argsort(probs, descending=True).tolist()
    keep = set(order[:p.top_k] if p.top_k else order)
    mass = 0.0
    kept_p = set()
    renorm = torch.softmax(torch.tensor([x[i].item() if i in keep else -math.inf for i in range(len(x))]), -1)
    for i in order:
        if i not in keep:
            continue
        if mass >= p.top_p:
            break
        kept_p.add(i)
        mass += renorm[i].item()
    y = torch.tensor([x[i].item() if i in kept_p else -math.inf for i in range(len(x))])
    q = torch.softmax(y, -1)
    if p.min_p:
        q = torch.where(q < p.min_p * q.max(), torch.zeros_like(q), q)
        q = q / q.sum()
    return q


def test_greedy_is_argmax_and_batch_independent():
    torch.manual_seed(0)
    logits = torch.randn(5, V)
    s = Sampler([EOS], seed=1)
    seqs = [seq(SamplingParams(temperature=0.0)) for _ in range(5)]
    out = s(logits, seqs)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert s(logits[2:3], seqs[2:3]).token_ids == [out.token_ids[2]]


def test_penalties_match_reference():
    torch.manual_seed(1)
    logits = torch.randn(3, V)
    ps = [SamplingParams(temperature=0.0, repetition_penalty=1.7),
          SamplingParams(temperature=0.0, presence_penalty=0.8, frequency_penalty=0.6),
          SamplingParams(temperature=0.0)]
    seqs = [seq(p, prompt=(1, 5), output=(5, 7, 7)) for p in ps]
    s = Sampler([EOS])
    ref = logits.clone()
    for i, p in enumerate(ps):
        for t in set([1, 5, 5, 7, 7]):
            if p.repetition_penalty != 1.0:
                ref[i, t] = ref[i, t] / 1.7 if ref[i, t] > 0 else ref[i, t] * 1.7
        for t, c in ((5, 1), (7, 2)):
            ref[i, t] -= p.frequency_penalty * c + p.presence_penalty
    work = logits.clone()
    Sampler._apply_penalties(work, seqs)
    torch.testing.assert_close(work, ref)
    assert s(logits, seqs).token_ids == ref.argmax(-1).tolist()


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    logits = torch.zeros(2, V)
    logits[:, EOS] = 10.0
    logits[:, 7] = 9.0
    logits[:, 4] = 8.0
    p = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[7])
    s = Sampler([EOS])
    out = s(logits, [seq(p, output=(1,)), seq(p, output=(1, 1))])
    assert out.token_ids == [4, EOS]
    ign = SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True)
    assert s(logits[:1], [seq(ign)]).token_ids == [EOS]  # ignore_eos: EOS is an ordinary token


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.3, top_k=4),
    SamplingParams(temperature=1.0, top_p=0.6),
    SamplingParams(temperature=0.9, top_k=6, top_p=0.8, min_p=0.1),
])
def test_sampling_distribution_matches_reference(params):
    torch.manual_seed(2)
    row = torch.randn(V) * 1.5
    ref = ref_filtered_probs(row, params)
    n = 3000
    s = Sampler([EOS], seed=3)
    seqs = [seq(params) for _ in range(n)]
    tokens = torch.tensor(s(row.expand(n, V).contiguous(), seqs).token_ids)
    freq = torch.bincount(tokens, minlength=V).float() / n
    assert set(tokens.tolist()) <= set(torch.nonzero(ref).flatten().tolist())
    assert (freq - ref).abs().max() < 0.035, (freq, ref)


def test_top_k_top_p_filter_against_reference():
    torch.manual_seed(4)
    logits = torch.randn(4, V)
    ps = [SamplingParams(top_k=3), SamplingParams(top_p=0.5), SamplingParams(top_k=5, top_p=0.7),
          SamplingParams(top_k=1)]
    got = Sampler._top_k_top_p(logits.clone(), ps)
    for i, p in enumerate(ps):
        ref = ref_filtered_probs(logits[i], p)
        assert torch.equal(torch.isfinite(got[i]), ref > 0)


def test_seeded_sampling_same_alone_and_batched():
    torch.manual_seed(5)
    p = SamplingParams(temperature=1.0, seed=1234)
    other = SamplingParams(temperature=1.0)
    rows = torch.randn(6, V)

    def run(batch):
        s = Sampler([EOS], seed=99 if batch else 7)
        mine = seq(p)
        toks = []
        for step in range(6):
            if batch:
                logits = torch.cat([torch.randn(2, V), rows[step:step + 1], torch.randn(3, V)])
                out = s(logits, [seq(other), seq(other), mine, seq(other), seq(other), seq(other)])
                toks.append(out.token_ids[2])
            else:
                toks.append(s(rows[step:step + 1], [mine]).token_ids[0])
        return toks

    assert run(False) == run(True)


def test_logprobs_top_k_plus_chosen():
    torch.manual_seed(6)
    logits = torch.randn(2, V)
    p = SamplingParams(temperature=0.0, logprobs=3)
    out = Sampler([EOS])(logits, [seq(p), seq(SamplingParams(temperature=0.0))])
    ref = torch.log_softmax(logits[0], -1)
    vals, ids = ref.topk(3)
    lp = out.logprobs[0]
    for v, i in zip(vals.tolist(), ids.tolist()):
        assert lp[i] == pytest.approx(v, abs=1e-6)
    assert out.chosen_logprobs[0] == pytest.approx(ref[out.token_ids[0]].item(), abs=1e-6)
    assert out.logprobs[1] is None


def test_logit_bias_applies_to_greedy_and_random_rows_alone():
    torch.manual_seed(7)
    logits = torch.randn(4, V)
    top = logits.argmax(-1).tolist()
    banned = SamplingParams(temperature=0.0, logit_bias={top[0]: -100})
    forced = SamplingParams(temperature=0.8, logit_bias={5: 100})
    plain = SamplingParams(temperature=0.0)
    s = Sampler([EOS], seed=8)
    out = s(logits, [seq(banned), seq(forced), seq(plain), seq(plain)])
    ref = logits[0].clone()
    ref[top[0]] -= 100
    assert out.token_ids[0] == ref.argmax().item() != top[0]
    assert out.token_ids[1] == 5
    assert out.token_ids[2:] == top[2:]  # the biased rows left their neighbours alone
    assert torch.equal(logits, logits.clone())  # the caller's logits are not edited


def test_logit_bias_ban_holds_over_many_random_draws():
    row = torch.zeros(V)
    row[2] = 5.0
    p = SamplingParams(temperature=1.0, logit_bias={2: -100, 9: -100})
    tokens = Sampler([EOS], seed=9)(row.expand(500, V).contiguous(), [seq(p) for _ in range(500)]).token_ids
    assert 2 not in tokens and 9 not in tokens


@pytest.mark.parametrize("seed", [2**64 - 1, -(2**63), 0])
def test_extreme_seeds_sample_reproducibly(seed):
    """The 64-bit edges: sample i of an n > 1 request seeds seed + i, which
    must wrap instead of overflowing torch's generator."""
    rows = torch.randn(2, V)
    p = SamplingParams(temperature=1.0, seed=seed, n=2)

    def draw():
        req = Request("r", None, [1, 2], p)
        req.seqs.append(type(req.seqs[0])(req, 1, [1, 2], "r#1"))
        return Sampler([EOS])(rows, req.seqs).token_ids

    assert draw() == draw()


def test_a_row_that_raises_fails_alone():
    """sample_isolated: the bad row is reported, the others keep the tokens
    they get without it (the seeded one included)."""
    torch.manual_seed(10)
    logits = torch.randn(3, V)
    bad = SamplingParams(temperature=1.0)
    bad.logit_bias = {10**6: 1.0}  # past validation, as a bug elsewhere could leave it
    seeded, greedy = SamplingParams(temperature=1.0, seed=42), SamplingParams(temperature=0.0)
    expect = Sampler([EOS])(logits[1:], [seq(seeded), seq(greedy)]).token_ids
    out, errors = Sampler([EOS]).sample_isolated(logits, [seq(bad), seq(seeded), seq(greedy)])
    assert list(errors) == [0] and out.token_ids[0] is None
    assert out.token_ids[1:] == expect
    with pytest.raises(Exception):
        Sampler([EOS])(logits, [seq(bad), seq(seeded), seq(greedy)])  # what the engine step used to hit


# -- structured output: the grammar mask -------------------------------------------------
# Real llguidance matchers over the default model's real tokenizer (vocab 49152).


@pytest.fixture(scope="module")
def grammars(default_model_fp32):
    from paged.core.engine.structured.compiler import GrammarCompiler

    return GrammarCompiler(default_model_fp32.tokenizer, default_model_fp32.config.vocab_size, [2])


def constrained_seq(grammars, params):
    s = seq(params)
    s.matcher = grammars.compile(params.structured_outputs).deep_copy()
    return s


def allowed(grammars, params, token: int) -> bool:
    return grammars.compile(params.structured_outputs).deep_copy().validate_tokens([token]) == 1


def test_grammar_rows_pick_allowed_tokens_and_free_rows_are_untouched(grammars):
    vocab = grammars.vocab_size
    torch.manual_seed(11)
    logits = torch.randn(4, vocab)
    digits = StructuredOutputsParams(regex=r"[0-9]{2,4}")
    greedy_c = SamplingParams(temperature=0.0, structured_outputs=digits)
    random_c = SamplingParams(temperature=1.0, seed=5, structured_outputs=digits)
    free_g, free_r = SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=6)
    s = Sampler([2])
    out = s(logits, [constrained_seq(grammars, greedy_c), seq(free_g), constrained_seq(grammars, random_c),
                     seq(free_r)])
    assert allowed(grammars, greedy_c, out.token_ids[0]) and allowed(grammars, random_c, out.token_ids[2])
    assert not allowed(grammars, greedy_c, logits[0].argmax().item())  # the mask changed something
    alone = Sampler([2])(logits[[1, 3]], [seq(free_g), seq(free_r)]).token_ids
    assert [out.token_ids[1], out.token_ids[3]] == alone


def test_grammar_mask_is_applied_after_logit_bias(grammars, default_model_fp32):
    letter = default_model_fp32.tokenizer.encode("a", add_special_tokens=False)[0]
    p = SamplingParams(temperature=0.0, logit_bias={letter: 100},
                       structured_outputs=StructuredOutputsParams(regex=r"[0-9]+"))
    logits = torch.zeros(1, grammars.vocab_size)
    token = Sampler([2])(logits, [constrained_seq(grammars, p)]).token_ids[0]
    assert token != letter and allowed(grammars, p, token)


def test_a_matcher_in_error_fails_its_row_alone(grammars, default_model_fp32):
    p = SamplingParams(temperature=0.0, structured_outputs=StructuredOutputsParams(regex=r"[0-9]+"))
    broken = constrained_seq(grammars, p)
    letter = default_model_fp32.tokenizer.encode("a", add_special_tokens=False)[0]
    assert not broken.matcher.consume_token(letter)  # not a digit: the matcher is in its error state for good
    ok = constrained_seq(grammars, p)
    logits = torch.randn(2, grammars.vocab_size)
    out, errors = Sampler([2]).sample_isolated(logits, [broken, ok])
    assert list(errors) == [0] and "grammar" in str(errors[0])
    assert allowed(grammars, p, out.token_ids[1])


def test_values_that_underflow_float32_still_sample_a_real_token():
    """A temperature of 1e-300 or a top_p of 5e-324 is 0 in float32: dividing
    by it, or keeping no token, made NaN rows that sampled token 0."""
    torch.manual_seed(12)
    logits = torch.randn(2, V)
    out = Sampler([EOS], seed=3)(logits, [seq(SamplingParams(temperature=1e-300)),
                                          seq(SamplingParams(temperature=0.7, top_p=5e-324))])
    assert out.token_ids == logits.argmax(-1).tolist()


def ref_inverse_cdf(row: torch.Tensor, u: float) -> int:
    """The first token whose running float64 sum exceeds u times the total."""
    vals = [float(v) for v in row]
    total = math.fsum(vals)
    run = 0.0
    for i, v in enumerate(vals):
        run += v
        if run > u * total:
            return i
    return max(i for i, v in enumerate(vals) if v > 0)


def test_inverse_cdf_matches_a_running_sum_and_never_picks_a_zero():
    from paged.core.engine.sampler import inverse_cdf_sample
    g = torch.Generator().manual_seed(21)
    probs = torch.rand(8, 500, generator=g) ** 4
    probs[:, 1::3] = 0.0  # a third of the tokens impossible
    probs[3, 200:] = 0.0  # the last tokens impossible: u near 1 must not reach them
    u = torch.rand(8, generator=g, dtype=torch.float64)
    u[3] = 1.0 - 2.0 ** -53
    got = inverse_cdf_sample(probs, u)
    assert got.tolist() == [ref_inverse_cdf(probs[i], float(u[i])) for i in range(8)]
    assert (probs[torch.arange(8), got] > 0).all()
    alone = torch.cat([inverse_cdf_sample(probs[i:i + 1], u[i:i + 1]) for i in range(8)])
    assert torch.equal(alone, got)


@pytest.mark.parametrize("scale, params", [
    (0.05, SamplingParams(top_p=0.9)),  # flat: the nucleus is most of the vocabulary
    (0.7, SamplingParams(top_p=0.95)),  # wide: past the first candidates, the cut inside a bucket
    (1.5, SamplingParams(top_p=0.99)),
    (6.0, SamplingParams(top_p=0.95)),  # peaked: a few tokens
    (0.05, SamplingParams(top_k=700, top_p=0.5)),
    (2.0, SamplingParams(top_k=300)),
])
def test_top_k_top_p_on_a_large_vocabulary_keeps_the_reference_set(scale, params):
    """Only a row's largest tokens are sorted (or, for a wide nucleus, one
    bucket of them); the kept set is the full sort's, alone or batched."""
    g = torch.Generator().manual_seed(22)
    logits = torch.randn(3, 3000, generator=g) * scale
    got = Sampler._top_k_top_p(logits.clone(), [params] * 3)
    for i in range(3):
        ref = ref_filtered_probs(logits[i], params)
        assert torch.equal(torch.isfinite(got[i]), ref > 0)
        assert torch.equal(got[i][ref > 0], logits[i][ref > 0])
        assert torch.equal(Sampler._top_k_top_p(logits[i:i + 1].clone(), [params])[0], got[i])


def test_penalties_equal_the_dense_formula_bitwise():
    """Penalties on the touched (row, token) pairs only == the same formula
    applied to every token of a large vocabulary ([N, V] counts)."""
    g = torch.Generator().manual_seed(23)
    vocab, n = 5000, 5
    logits = torch.randn(n, vocab, generator=g) * 4
    ps = [SamplingParams(temperature=0.0, repetition_penalty=1.3),
          SamplingParams(temperature=0.0, presence_penalty=0.7, frequency_penalty=-0.4),
          SamplingParams(temperature=0.0, repetition_penalty=0.8, presence_penalty=-1.0, frequency_penalty=0.3),
          SamplingParams(temperature=0.0),
          SamplingParams(temperature=0.0, frequency_penalty=1.1)]
    seqs = []
    for i, p in enumerate(ps):
        prompt = torch.randint(0, vocab, (40 + i,), generator=g).tolist()
        output = torch.randint(0, vocab // 50, (30,), generator=g).tolist() if i != 4 else []  # repeats
        seqs.append(seq(p, prompt=prompt, output=output))
    dense = logits.clone()
    for i, (s, p) in enumerate(zip(seqs, ps)):
        counts = torch.zeros(vocab)
        for tok in s.output_token_ids:
            counts[tok] += 1
        seen = counts > 0
        if p.repetition_penalty != 1.0:
            seen[torch.tensor(s.token_ids)] = True
        row = dense[i]
        penalised = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
        row.copy_(torch.where(seen, penalised, row))
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
    work = logits.clone()
    Sampler._apply_penalties(work, seqs)
    assert torch.equal(work, dense)
