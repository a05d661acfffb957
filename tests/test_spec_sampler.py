"""Rejection sampling of n-gram drafts (core/engine/sampler.py, step 7) follows the
target distribution. Oracle: the distribution p itself, computed
independently here (softmax of the logits / temperature, top-k / top-p /
min-p applied by hand), and the accept() walk of core/engine/spec_decode.py.

A row verifying draft d must give token t with probability p(t) whatever d
is, and give d back (accept) with probability p(d). Each case draws 20000
rows with a fixed seed and applies Pearson's chi-square test at a threshold
whose false-alarm probability is 1e-6; a sampler that always accepted the
draft, never did, or resampled without removing d shifts some cell by far
more than that (checked against the same threshold below).
"""

from __future__ import annotations

import pytest
import torch

from paged.core.engine.request import Request
from paged.core.engine.sampler import Sampler
from paged.core.engine.sampling_params import SamplingParams
from paged.core.engine.spec_decode import accept

N = 20000
LOGITS = torch.tensor([2.0, 1.5, 0.3, -0.5, 1.0, -2.0])
#: chi-square quantile with P(X > q) = 1e-6, by degrees of freedom (scipy.stats.chi2.isf(1e-6, df))
CHI2_1E6 = {1: 23.93, 2: 27.63, 3: 30.66, 4: 33.38, 5: 35.89}


def seqs_for(params: SamplingParams, n: int):
    req = Request("r", None, [1, 2, 3], params)
    return [req.seqs[0]] * n


def target(params: SamplingParams) -> torch.Tensor:
    """p by hand, in float64."""
    x = LOGITS.double() / params.temperature
    p = torch.softmax(x, 0)
    order = torch.argsort(p, descending=True)
    keep = torch.zeros_like(p, dtype=torch.bool)
    mass = 0.0
    for rank, i in enumerate(order.tolist()):
        if (params.top_k > 0 and rank >= params.top_k) or (rank > 0 and mass >= params.top_p):
            break
        keep[i] = True
        mass += float(p[i])
    p = torch.where(keep, p, 0.0)
    p = p / p.sum()
    if params.min_p:
        p = torch.where(p >= params.min_p * p.max(), p, 0.0)
        p = p / p.sum()
    return p


def chi2(counts: torch.Tensor, p: torch.Tensor) -> tuple[float, int]:
    live = p > 0
    assert int(counts[~live].sum()) == 0, "a token outside the support was sampled"
    expected = p[live] * counts.sum()
    return float(((counts[live] - expected) ** 2 / expected).sum()), int(live.sum()) - 1


def draw(params, drafts, seed=1234):
    sampler = Sampler([], seed=seed)
    out = sampler(LOGITS.repeat(len(drafts), 1), seqs_for(params, len(drafts)), drafts)
    return torch.tensor(out.token_ids)


CASES = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=4),
         SamplingParams(temperature=1.3, top_p=0.8), SamplingParams(temperature=1.0, min_p=0.1)]


@pytest.mark.parametrize("params", CASES, ids=["plain", "top_k", "top_p", "min_p"])
@pytest.mark.parametrize("draft", [0, 3, 5])  # the likeliest token, an unlikely one, one filtered out by some
def test_verified_row_follows_the_target(params, draft):
    p = target(params)
    tokens = draw(params, [draft] * N)
    counts = torch.bincount(tokens, minlength=len(p)).double()
    stat, df = chi2(counts, p)
    assert stat < CHI2_1E6[df], f"chi2 {stat:.1f} over {df} dof: counts {counts.tolist()} vs p {p.tolist()}"


def test_wrong_rules_would_fail_the_same_bound():
    """The bound has power: the expected counts of a wrong verifier (always
    accept the draft; on rejection resample from p without removing it)
    sit far beyond what the test lets through."""
    p = target(CASES[0])
    d = 3
    always = torch.zeros_like(p)
    always[d] = 1.0
    keep_d = (1 - p[d]) * p  # rejected: d drawn again from the full p
    keep_d[d] += p[d]
    for wrong in (always, keep_d):
        stat, df = chi2(wrong * N, p)
        assert stat > 10 * CHI2_1E6[df], stat


def test_two_row_walk_matches_the_joint_distribution():
    """Two rows verifying drafts (a, b): the emitted runs follow the joint
    law of two plain steps (rows share the logits, so tokens are i.i.d. p):
    the first token t1 ~ p; the second exists only when t1 == a, and is ~ p."""
    params = SamplingParams(temperature=1.0)
    p = target(params)
    a, b = 0, 1
    sampler = Sampler([], seed=99)
    rows = sampler(LOGITS.repeat(2 * N, 1), seqs_for(params, 2 * N), [a, b] * N).token_ids
    runs = [accept(rows[2 * i:2 * i + 2], [a]) for i in range(N)]
    first = torch.bincount(torch.tensor([r[0] for r in runs]), minlength=len(p)).double()
    stat, df = chi2(first, p)
    assert stat < CHI2_1E6[df]
    second = torch.tensor([r[1] for r in runs if len(r) == 2])
    assert abs(len(second) / N - float(p[a])) < 5 * (float(p[a] * (1 - p[a])) / N) ** 0.5
    stat, df = chi2(torch.bincount(second, minlength=len(p)).double(), p)
    assert stat < CHI2_1E6[df]


def test_greedy_rows_take_the_argmax_whatever_the_draft():
    params = SamplingParams(temperature=0.0)
    out = Sampler([], seed=0)(LOGITS.repeat(3, 1), seqs_for(params, 3), [0, 3, None])
    assert out.token_ids == [0, 0, 0]
    assert accept(out.token_ids, [0, 3]) == [0, 0]
