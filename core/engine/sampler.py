"""Turns the logits of the sequences that sample this step into tokens.

Vectorised over the batch; every step is a row-wise operation, so a row's
result does not depend on what else is in the batch. Order of processing:

1. logprobs (when requested) are taken from the raw model logits;
2. repetition / presence / frequency penalties (OpenAI / vLLM semantics:
   repetition over prompt + output, presence / frequency over the output);
3. EOS and stop_token_ids are masked while fewer than min_tokens were generated;
4. logit_bias is added (OpenAI semantics: before sampling, so greedy rows see it too);
5. structured output: tokens the row's grammar does not allow are set to -inf,
   all constrained rows in one pass (core/engine/structured/mask.py), last, so no
   bias or penalty can bring a forbidden token back;
6. temperature 0 rows (and below 1e-5, as vLLM: dividing by such a
   temperature overflows float32 into NaN) take the argmax; the others are divided by their
   temperature, filtered by top_k, top_p, min_p and sampled by inverse
   CDF (one uniform a row against the float64 cumulative mass), drawing the
   uniform from the sequence's own torch.Generator when it has a seed, so a
   seeded request gives the same tokens alone or batched;
7. speculative decoding (core/engine/spec_decode.py): a row given a draft token d
   verifies it. Greedy rows take the argmax as always (the caller compares).
   Sampled rows use rejection sampling with the n-gram proposer's point-mass
   draft distribution: d is accepted with probability p(d) (p: the row's
   distribution after step 6's filters); otherwise the token is drawn from p
   with d removed, renormalised. Either way the row's token follows p exactly.

A row that cannot be sampled must not take the batch down with it:
sample_isolated() falls back to one row at a time and reports the rows
that raise, and every per-row generator exists before any noise is drawn,
so a failing row leaves the other rows' seeded streams untouched.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from paged.core.engine.outputs import TokenLogprobs
from paged.core.engine.request import Sequence
from paged.core.engine.structured.mask import GrammarMasker, check_allowed


#: temperatures below this sample greedily (1 / 1e-5 keeps float32 logits finite)
MIN_TEMPERATURE = 1e-5


@dataclass
class SamplerOutput:
    token_ids: list[Optional[int]]  # None only for the failed rows of sample_isolated()
    logprobs: list[Optional[TokenLogprobs]]  # per row: top-k + chosen, or None when not requested
    chosen_logprobs: list[Optional[float]]


def top_logprobs(logprobs_row: torch.Tensor, k: int, chosen: Optional[int]) -> TokenLogprobs:
    """{token_id: logprob} for the k most likely tokens plus the chosen one."""
    out: TokenLogprobs = {}
    if k:
        vals, ids = logprobs_row.topk(k)
        out = dict(zip(ids.tolist(), vals.tolist()))
    if chosen is not None and chosen not in out:
        out[chosen] = float(logprobs_row[chosen])
    return out


#: top_p's candidate count per row (Sampler._top_k_top_p)
TOP_P_CANDIDATES = 256
#: _wide_nucleus's buckets: a float32 probability's bits shifted right by
#: this many, its exponent and top 3 mantissa bits (buckets 2^(1/8) wide)
NUCLEUS_BUCKET_SHIFT = 20


def _wide_nucleus(row: torch.Tensor, top_p: float) -> torch.Tensor:
    """One row's logits [V] with the tokens outside its top_p nucleus set
    to -inf, without sorting the row: the probabilities are bucketed by
    their leading bits (larger bucket, larger probability), the buckets'
    masses (float64) summed from the top find the bucket where the mass
    reaches top_p; every token above it is kept, every token below it
    dropped, and only that bucket's tokens are sorted to place the cut.
    The same set as sorting the whole row (up to the order of equal
    probabilities and the rounding of the sums): ~2 ms at 152k tokens
    where a sort takes ~12."""
    probs = torch.softmax(row, dim=-1)
    keys = (probs.view(torch.int32) >> NUCLEUS_BUCKET_SHIFT).long()  # probs >= 0: keys order them
    mass = torch.zeros(int(keys.max()) + 1, dtype=torch.float64).scatter_add_(0, keys, probs.double())
    above = mass.flip(0).cumsum(0).flip(0)  # above[k]: the mass of every bucket >= k
    reach = (above >= top_p).nonzero()
    if not len(reach):  # float32 rounding left the whole row short of top_p: all of it
        return row.clone()
    b = int(reach.max())  # the bucket holding the cut: buckets above it hold less than top_p
    before_b = float(above[b + 1]) if b + 1 < len(above) else 0.0
    members = (keys == b).nonzero().flatten()
    member_probs, member_order = probs[members].double().sort(descending=True)
    kept = keys > b
    kept[members[member_order[before_b + member_probs.cumsum(0) - member_probs < top_p]]] = True
    return row.masked_fill(~kept, float("-inf"))


def inverse_cdf_sample(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of probs [N, V] (>= 0, not necessarily normalised)
    for uniforms u [N] float64 in [0, 1): the first token whose cumulative
    mass (float64, summed in token order: a row's bits do not depend on the
    batch) exceeds u times the row's total, so token t is drawn with
    probability p[t] / sum p and a zero-probability token never. One
    uniform a row: drawing V exponentials for the exponential race cost
    ~1 ms a row at 49k tokens, 3 ms at 152k."""
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)
    ids = torch.searchsorted(cdf, u.to(cdf.device)[:, None] * cdf[:, -1:], right=True).squeeze(1)
    over = (ids == probs.shape[1]).nonzero().flatten().tolist()
    for r in over:  # u * total rounded up to the total: the last token with mass
        ids[r] = int((cdf[r] < cdf[r, -1]).sum())
    return ids


class Sampler:
    def __init__(self, eos_token_ids: list[int], seed: Optional[int] = None,
                 argmax: Optional[Callable[[torch.Tensor], torch.Tensor]] = None):
        self.eos_token_ids = list(eos_token_ids)  # the model's end-of-generation ids
        # logits [N, V] -> int64 [N], torch.argmax's answer: the platform's (Platform.argmax)
        self.argmax = argmax or (lambda t: t.argmax(dim=-1))
        self.generator = torch.Generator()
        self.generator.manual_seed(seed if seed is not None else torch.seed())
        self._masker: Optional[GrammarMasker] = None  # made on the first constrained row

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence],
                 drafts: Optional[list[Optional[int]]] = None) -> SamplerOutput:
        """logits: float32 [N, V], row i for seqs[i] (rows may be shared by the
        samples of an n > 1 request: pass them expanded). drafts[i]: the
        draft token row i verifies, or None (step 7)."""
        n = len(seqs)
        params = [s.params for s in seqs]
        want_lp = [p.logprobs is not None for p in params]
        logprobs = torch.log_softmax(logits, dim=-1) if any(want_lp) else None
        penalise = any(p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty for p in params)
        masked = [i for i, s in enumerate(seqs) if s.num_output_tokens < s.params.min_tokens]
        biased = [i for i, p in enumerate(params) if p.logit_bias]
        constrained = [i for i, s in enumerate(seqs) if s.matcher is not None]
        if penalise or masked or biased or constrained:
            logits = logits.clone()  # edited in place below; the caller's logits stay as they were
        if penalise:
            self._apply_penalties(logits, seqs)
        self._mask_until_min_tokens(logits, [seqs[i] for i in masked], masked)
        for i in biased:
            bias = params[i].logit_bias
            logits[i, list(bias)] += torch.tensor(list(bias.values()), dtype=logits.dtype)
        bitmask = None
        if constrained:
            bitmask = self._grammar_mask(logits).apply(logits, constrained, [seqs[i].matcher for i in constrained])

        temps = [p.temperature for p in params]
        rand_rows = [i for i in range(n) if temps[i] >= MIN_TEMPERATURE]
        rand_drafts = [drafts[i] for i in rand_rows] if drafts else None
        if len(rand_rows) == n:  # no greedy row: no argmax of the raw logits
            tokens = self._sample_random(logits, seqs, rand_drafts)
        else:
            tokens = self.argmax(logits)  # the sampled rows' entries are overwritten
            if rand_rows:
                tokens[rand_rows] = self._sample_random(logits[rand_rows], [seqs[i] for i in rand_rows], rand_drafts)
        token_list = tokens.tolist()
        if bitmask is not None:
            check_allowed(bitmask, [token_list[i] for i in constrained])

        lp_out: list[Optional[TokenLogprobs]] = [None] * n
        chosen: list[Optional[float]] = [None] * n
        for i in range(n):
            if want_lp[i]:
                lp_out[i] = top_logprobs(logprobs[i], params[i].logprobs, token_list[i])
                chosen[i] = lp_out[i][token_list[i]]
        return SamplerOutput(token_list, lp_out, chosen)

    def sample_isolated(self, logits: torch.Tensor, seqs: list[Sequence],
                        drafts: Optional[list[Optional[int]]] = None) -> tuple[SamplerOutput, dict[int, Exception]]:
        """Like calling the sampler, but a row that raises fails alone: the
        batch is then sampled row by row (rows are independent) and the
        failing rows come back as {row: exception}, their token None."""
        try:
            return self(logits, seqs, drafts), {}
        except Exception:  # noqa: BLE001 - find the rows at fault below
            pass
        out = SamplerOutput([None] * len(seqs), [None] * len(seqs), [None] * len(seqs))
        errors: dict[int, Exception] = {}
        for i in range(len(seqs)):
            try:
                row = self(logits[i:i + 1], seqs[i:i + 1], drafts[i:i + 1] if drafts else None)
            except Exception as exc:  # noqa: BLE001 - reported to this row's request only
                errors[i] = exc
                continue
            out.token_ids[i], out.logprobs[i], out.chosen_logprobs[i] = \
                row.token_ids[0], row.logprobs[0], row.chosen_logprobs[0]
        return out, errors

    # -- logits processors ---------------------------------------------------------
    @staticmethod
    def _apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> None:
        """In place, on the (row, token) pairs a penalty touches only: a
        row's output tokens, and its prompt's too under a repetition
        penalty (dense [N, V] counts cost ~27 ms a step at 16 rows of a 152k
        vocabulary). The same float32 operations per element as on every
        token: tokens no penalty touches would have stayed as they were."""
        rows, toks, counts = [], [], []
        for i, s in enumerate(seqs):
            out_ids, out_counts = torch.tensor(s.output_token_ids, dtype=torch.int64).unique(return_counts=True)
            ids = out_ids
            if s.params.repetition_penalty != 1.0:  # every token of the sequence; the output's are among them
                ids = torch.tensor(s.token_ids, dtype=torch.int64).unique()
            c = torch.zeros(len(ids), dtype=logits.dtype)
            c[torch.searchsorted(ids, out_ids)] = out_counts.to(logits.dtype)
            rows.append(torch.full((len(ids),), i, dtype=torch.int64))
            toks.append(ids)
            counts.append(c)
        r, t, c = torch.cat(rows), torch.cat(toks), torch.cat(counts)
        if not len(r):
            return
        rep = torch.tensor([s.params.repetition_penalty for s in seqs], dtype=logits.dtype)[r]
        pres = torch.tensor([s.params.presence_penalty for s in seqs], dtype=logits.dtype)[r]
        freq = torch.tensor([s.params.frequency_penalty for s in seqs], dtype=logits.dtype)[r]
        v = logits[r, t]
        v = torch.where(v > 0, v / rep, v * rep)  # repetition (1.0 where the row has none: exact)
        logits[r, t] = v - (freq * c + pres * (c > 0).to(logits.dtype))

    def _grammar_mask(self, logits: torch.Tensor) -> GrammarMasker:
        if self._masker is None:
            self._masker = GrammarMasker(logits.shape[1])
        return self._masker

    def _mask_until_min_tokens(self, logits: torch.Tensor, seqs: list[Sequence], rows: list[int]) -> None:
        """Forbid stop tokens (and EOS unless ignored) in `rows`, whose
        sequences (`seqs`, same order) have not reached min_tokens."""
        for i, s in zip(rows, seqs):
            p = s.params
            ids = list(p.stop_token_ids)
            if not p.ignore_eos:
                ids += self.eos_token_ids
            if ids:
                logits[i, ids] = float("-inf")

    def _sample_random(self, logits: torch.Tensor, seqs: list[Sequence],
                       drafts: Optional[list[Optional[int]]] = None) -> torch.Tensor:
        params = [s.params for s in seqs]
        logits = logits / torch.tensor([p.temperature for p in params], dtype=logits.dtype)[:, None]
        vocab = logits.shape[1]
        filt = [i for i, p in enumerate(params) if (0 < p.top_k < vocab) or p.top_p < 1.0]
        if filt:
            logits[filt] = self._top_k_top_p(logits[filt], [params[i] for i in filt])
        probs = torch.softmax(logits, dim=-1)
        min_ps = [p.min_p for p in params]
        if any(min_ps):
            thresh = torch.tensor(min_ps, dtype=probs.dtype)[:, None] * probs.amax(dim=-1, keepdim=True)
            probs = probs.masked_fill(probs < thresh, 0.0)
        generators = [self._generator_for(s) for s in seqs]  # all made before any draw
        drafts = drafts or [None] * len(seqs)
        # per row, from its generator: the draft's acceptance draw (drafted rows), then the sample's
        accept = torch.zeros(len(seqs), dtype=torch.float64)
        u = torch.empty(len(seqs), dtype=torch.float64)
        for i, (gen, d) in enumerate(zip(generators, drafts)):
            if d is not None:
                accept[i:i + 1].uniform_(generator=gen)
            u[i:i + 1].uniform_(generator=gen)
        rows = [i for i, d in enumerate(drafts) if d is not None]
        if not rows:
            return inverse_cdf_sample(probs, u)
        # step 7: accept d with probability p(d) (probs may be unnormalised after min_p), else drop it from p
        r, d = torch.tensor(rows), torch.tensor([drafts[i] for i in rows])
        ok = accept[r] * probs[r].sum(dim=-1, dtype=torch.float64) < probs[r, d].double()
        probs[r[~ok], d[~ok]] = 0.0
        tokens = inverse_cdf_sample(probs, u)
        tokens[r[ok]] = d[ok]
        return tokens

    @staticmethod
    def _top_k_top_p(logits: torch.Tensor, params) -> torch.Tensor:
        """The rows' logits with what top_k and top_p drop set to -inf. The
        kept tokens are usually the largest few, so only the c largest of a
        row are sorted (torch.topk; sorting a 152k vocabulary costs ~12 ms a
        row): a row's top_k tokens, else TOP_P_CANDIDATES. A top_p row whose
        nucleus runs past them takes _wide_nucleus."""
        vocab = logits.shape[1]
        k_list = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        ks = torch.tensor(k_list)
        ps = torch.tensor([p.top_p if p.top_p < 1.0 else 2.0 for p in params], dtype=logits.dtype)
        # a row's softmax runs over its top-k tokens: all of them must be candidates
        c = min(vocab, max(k if k < vocab else TOP_P_CANDIDATES for k in k_list))
        vals, order = logits.topk(c, dim=-1)  # descending
        ranks = torch.arange(c)[None, :]
        vals = vals.masked_fill(ranks >= ks[:, None], float("-inf"))
        norm = torch.logsumexp(vals, dim=-1, keepdim=True)  # a top_k row's softmax runs over its candidates
        whole = (ks == vocab).nonzero().flatten()
        if len(whole):  # the others' over the whole row
            norm[whole] = torch.logsumexp(logits[whole], dim=-1, keepdim=True)
        probs = torch.exp(vals - norm)
        mass = probs.cumsum(dim=-1)
        # keep the smallest prefix whose mass reaches top_p, and always the first
        # token (a top_p that underflows float32 to 0 would otherwise drop them all)
        vals = vals.masked_fill((mass - probs >= ps[:, None]) & (ranks > 0), float("-inf"))
        out = torch.full_like(logits, float("-inf")).scatter_(1, order, vals)
        # rows without top_k whose candidates hold less than top_p (a NaN row compares false: rank 0 alone)
        for r in ((mass[:, -1] < ps) & (ks == vocab) & (c < vocab)).nonzero().flatten().tolist():
            out[r] = _wide_nucleus(logits[r], float(ps[r]))
        return out

    def _generator_for(self, seq: Sequence) -> torch.Generator:
        seed = seq.params.seed
        if seed is None:
            return self.generator
        if seq.generator is None:
            seq.generator = torch.Generator()
            # sample i of an n > 1 request: seed + i, wrapped into the 64 bits torch takes
            seq.generator.manual_seed((seed + seq.index) % 2**64)
        return seq.generator
