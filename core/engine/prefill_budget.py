"""How many prompt tokens a step may carry while sequences decode, from a
time target (``--itl-target-ms``) instead of a fixed token count.

A step runs decodes and prompt chunks in one forward, so a decoding
sequence's inter-token latency (ITL) is the whole step's time. What a
prompt token costs depends on the machine: on two Zen 4 cores a step of 16
decodes takes ~35 ms and each prompt token adds ~1 ms, while a many-core
server or a GPU runs 128 prompt tokens in a few ms. So the engine learns its own step time
online, from every step it runs:

    t = a + c_d * n_d + c_p * n_p

``n_d``: rows that generate a token (decodes and verify rows), ``n_p``:
prompt rows, ``t``: wall seconds from the forward's start to the sampled
tokens. The fit is recursive least squares with a forgetting factor
(``FORGET`` 0.9: the last ~10 steps weigh most, so it follows a change of
load within tens of steps) on relative errors: each step is divided by its
own time, so a 40 ms decode step counts as much as a 600 ms prefill and a
step slowed 3x by a neighbour (this machine is shared) weighs a ninth. A
residual beyond ``CLIP`` times the running mean relative error, measured in
units of the prediction's own uncertainty (so a kind of step the fit has
seen little of, like the first prompts after decodes only, is information,
not an outlier), is clipped Huber-style before it updates the fit; a lasting
change of cost widens that mean within a few steps, so it is learned, not
clipped away. The covariance is bounded (no wind-up while a direction goes
unobserved, e.g. no prompts for a while), bad times are ignored, and a fit
that ever turns non-finite restarts from the prior: no prediction is ever
negative or NaN.

The rule, for a step whose decodes and verifies take ``n_d`` rows
(``T_d`` = their predicted time alone, ``c_p`` = the per-token cost):

    tokens = min(cap, max(most that keeps T_d + c_p * n <= target,
                          MIN_TOKENS, FLOOR_SHARE * T_d / c_p))

The floor gives prompts at least ``FLOOR_SHARE`` (half) of the decodes'
own time, so a step is at most ~1.5x its decode-only time when the decodes
alone are near or over the target (prompts always progress; time to first
token does not starve); ``MIN_TOKENS`` keeps chunks from getting too small to be worth a
step. Until ``MIN_OBSERVATIONS`` steps (some with prompts, some with
decodes) were seen, the answer is ``UNTRAINED_TOKENS`` (or the cap if
smaller): a size that keeps a step short even on a slow CPU, since the
first steps with decodes come in a burst of new requests, exactly when the
inter-token latency is measured.
"""

from __future__ import annotations

import math
from typing import Optional

#: forgetting factor of the least-squares fit (memory ~ 1 / (1 - FORGET) steps)
FORGET = 0.9
#: residuals beyond CLIP x the mean relative error are clipped (Huber)
CLIP = 4.0
#: the mean relative error never counts as below this (2%): a quiet spell does not make every step an outlier
MIN_SCALE = 0.02
#: weight of the newest residual in the mean relative error
SCALE_RATE = 0.3
#: prompt tokens a step carrying decodes may always take
MIN_TOKENS = 16
#: share of the decodes' predicted time that prompts always get (docs/engine.md: 1.0 gave an ITL
#: p99 of 120-264 ms at 16 streams on two Zen 4 cores, 0.5 101-133 ms, same output tok/s)
FLOOR_SHARE = 0.5
#: prompt tokens a step with decodes may take before the fit is ready (~35 ms on two Zen 4 cores)
UNTRAINED_TOKENS = 32
#: steps observed (and steps with prompts, with decodes) before the rule applies
MIN_OBSERVATIONS = 8
MIN_OBSERVED_EACH = 2
#: prior variance of each coefficient (weak), and the bound on the covariance's trace
PRIOR_VAR = 1e3
#: a per-token cost never counts as less than this (seconds): a free-looking token does not divide by zero
MIN_TOKEN_COST = 1e-9


class PrefillBudget:
    """The step-time model and the budget rule; one per engine (rank 0)."""

    def __init__(self, target_s: float, cap: Optional[int] = None, min_tokens: int = MIN_TOKENS):
        if not isinstance(target_s, (int, float)) or isinstance(target_s, bool) or not target_s > 0 \
                or not math.isfinite(target_s):
            raise ValueError(f"target_s: expected a positive number of seconds, got {target_s!r}")
        if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool) or cap < 1):
            raise ValueError(f"cap: expected an integer >= 1 or None, got {cap!r}")
        self.target_s = float(target_s)
        self.cap = cap
        self.min_tokens = min_tokens if cap is None else min(min_tokens, cap)
        self.last_tokens: Optional[int] = None  # the latest budget given (None: no step with decodes yet)
        self._reset()

    def _reset(self) -> None:
        self.theta = [0.0, 0.0, 0.0]  # a, c_d, c_p (seconds)
        self.P = [[PRIOR_VAR if i == j else 0.0 for j in range(3)] for i in range(3)]
        self.scale = 0.1  # running mean |relative error|
        self.num_observed = self.num_with_prompts = self.num_with_decodes = 0

    # -- learning ----------------------------------------------------------------
    def observe(self, num_decode_rows: int, num_prompt_rows: int, seconds: float) -> None:
        """One finished step; ignored when it carried nothing or its time is
        not a finite non-negative number."""
        if num_decode_rows < 0 or num_prompt_rows < 0 or num_decode_rows + num_prompt_rows == 0 \
                or not math.isfinite(seconds) or seconds < 0:
            return
        x = (1.0, float(num_decode_rows), float(num_prompt_rows))
        unit = max(seconds, 1e-6)  # relative errors: each step weighs 1 / its time squared
        xs = [v / unit for v in x]
        r = seconds / unit - self._dot(xs)
        if self.num_observed >= MIN_OBSERVATIONS:
            # the residual in units of its expected spread: a step in a direction the fit has
            # seen little of (leverage x^T P x large) is information, not an outlier
            spread = math.sqrt(1 + max(self._leverage(xs), 0.0))
            z = max(-CLIP * self.scale, min(CLIP * self.scale, r / spread))
            self.scale = max(MIN_SCALE, (1 - SCALE_RATE) * self.scale + SCALE_RATE * abs(z))
            r = z * spread
        self._update(xs, r)
        self.num_observed += 1
        self.num_with_prompts += num_prompt_rows > 0
        self.num_with_decodes += num_decode_rows > 0

    def _update(self, x: list[float], r: float) -> None:
        """Recursive least squares with forgetting: theta += k r, P = (P - k x^T P) / FORGET."""
        P = self.P
        px = [sum(P[i][j] * x[j] for j in range(3)) for i in range(3)]
        denom = FORGET + sum(x[i] * px[i] for i in range(3))
        k = [v / denom for v in px]
        theta = [self.theta[i] + k[i] * r for i in range(3)]
        P = [[(P[i][j] - k[i] * px[j]) / FORGET for j in range(3)] for i in range(3)]
        P = [[(P[i][j] + P[j][i]) / 2 for j in range(3)] for i in range(3)]  # keep it symmetric
        trace = P[0][0] + P[1][1] + P[2][2]
        if trace > 3 * PRIOR_VAR:  # no wind-up in a direction no step excites
            P = [[v * 3 * PRIOR_VAR / trace for v in row] for row in P]
        finite = all(math.isfinite(v) for v in theta + [v for row in P for v in row])
        if not finite or min(P[i][i] for i in range(3)) < 0:  # numerically lost: start again
            self._reset()
            return
        self.theta, self.P = theta, P

    def _leverage(self, x: list[float]) -> float:
        return sum(x[i] * self.P[i][j] * x[j] for i in range(3) for j in range(3))

    def _dot(self, x) -> float:
        return sum(t * v for t, v in zip(self.theta, x))

    # -- predictions -----------------------------------------------------------------
    @property
    def ready(self) -> bool:
        return (self.num_observed >= MIN_OBSERVATIONS and self.num_with_prompts >= MIN_OBSERVED_EACH
                and self.num_with_decodes >= MIN_OBSERVED_EACH)

    @property
    def token_cost_s(self) -> float:
        """Predicted seconds one more prompt token adds to a step (> 0)."""
        return max(self.theta[2], MIN_TOKEN_COST)

    def decode_time_s(self, num_decode_rows: int) -> float:
        """Predicted seconds of a step carrying only these decode rows (>= 0)."""
        return max(self.theta[0] + self.theta[1] * num_decode_rows, 0.0)

    def tokens(self, num_decode_rows: int) -> Optional[int]:
        """Prompt tokens a step carrying ``num_decode_rows`` decode / verify
        rows may add."""
        if not self.ready:
            n = UNTRAINED_TOKENS if self.cap is None else min(self.cap, UNTRAINED_TOKENS)
        else:
            decodes, cost = self.decode_time_s(num_decode_rows), self.token_cost_s
            fits = math.floor((self.target_s - decodes) / cost) if decodes < self.target_s else 0
            floor = max(self.min_tokens, math.floor(FLOOR_SHARE * decodes / cost))
            n = max(fits, floor)
            n = n if self.cap is None else min(n, self.cap)
        self.last_tokens = n
        return n

    def stats(self) -> dict:
        return {"prefill_budget_tokens": self.last_tokens if self.last_tokens is not None else self.cap,
                "prefill_token_cost_s": self.token_cost_s if self.ready else None}
