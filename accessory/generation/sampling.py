"""Turning logits into the next token. Randomness only from the generator passed in.

Sampling cannot fail on parameters that passed `SamplingParams`: a temperature below MIN_TEMPERATURE is greedy
(dividing by it would overflow), and penalties and biases stay within their ranges. What remains, logits that are
not numbers (a broken model), raises SamplingError for that row alone.

The order, as vLLM's: logit bias, the penalties (repetition over prompt and output, HF's rule; presence and
frequency over the output, OpenAI's), then greedy argmax, or temperature, min_p, top-k and top-p.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

MIN_TEMPERATURE = 1e-5  # below this, sampling is greedy (as vLLM): logits / 1e-38 overflow float32
REPETITION_PENALTY_RANGE = (0.01, 100.0)  # beyond these, penalized logits reach inf
PENALTY_RANGE = (-2.0, 2.0)  # presence and frequency penalties, as OpenAI's
LOGIT_BIAS_RANGE = (-100.0, 100.0)
MAX_LOGPROBS = 20  # most likely tokens reported beside each chosen one, at most (OpenAI's limit)
NAN_LOGITS = "the logits hold NaN"


class SamplingError(ValueError):
    """A row's probabilities are not a distribution (NaN, or no mass): that row ends, the others go on."""


@dataclass(frozen=True)
class SamplingParams:
    max_gen_len: int = 512
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 0.95  # nucleus mass, in (0, 1]
    top_k: int = 0  # 0 = no top-k cut
    repetition_penalty: float = 1.0  # 1 = off; > 1 discourages tokens already in the row (CTRL / HF rule)
    min_p: float = 0.0  # keep tokens at least this fraction as likely as the most likely one; 0 = off
    presence_penalty: float = 0.0  # subtracted from a token's logit once it is in the output
    frequency_penalty: float = 0.0  # subtracted once per time a token is in the output
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    logprobs: Optional[int] = None  # None: no log-probs; k: the chosen token's and the k most likely ones
    prompt_logprobs: Optional[int] = None  # as logprobs, for each prompt token after the first (OpenAI's echo)

    def __post_init__(self):
        low, high = REPETITION_PENALTY_RANGE
        checks = {
            "max_gen_len": (self.max_gen_len, _integer(self.max_gen_len) and self.max_gen_len >= 1, "an integer >= 1"),
            "temperature": (self.temperature, _number(self.temperature) and self.temperature >= 0,
                            "a finite number >= 0"),
            "top_p": (self.top_p, _number(self.top_p) and 0 < self.top_p <= 1, "in (0, 1]"),
            "top_k": (self.top_k, _integer(self.top_k) and self.top_k >= 0, "an integer >= 0"),
            "repetition_penalty": (self.repetition_penalty, _within(self.repetition_penalty, (low, high)),
                                   f"in [{low}, {high}]"),
            "min_p": (self.min_p, _within(self.min_p, (0, 1)), "in [0, 1]"),
            "presence_penalty": (self.presence_penalty, _within(self.presence_penalty, PENALTY_RANGE),
                                 f"in {list(PENALTY_RANGE)}"),
            "frequency_penalty": (self.frequency_penalty, _within(self.frequency_penalty, PENALTY_RANGE),
                                  f"in {list(PENALTY_RANGE)}"),
            "logit_bias": (self.logit_bias, all(_integer(t) and t >= 0 and _within(b, LOGIT_BIAS_RANGE)
                                                for t, b in self.logit_bias),
                           f"pairs of a token id >= 0 and a bias in {list(LOGIT_BIAS_RANGE)}"),
            "logprobs": (self.logprobs, _top_count(self.logprobs), f"None or an integer in [0, {MAX_LOGPROBS}]"),
            "prompt_logprobs": (self.prompt_logprobs, _top_count(self.prompt_logprobs),
                                f"None or an integer in [0, {MAX_LOGPROBS}]"),
        }
        for name, (value, ok, expected) in checks.items():
            if not ok:
                raise ValueError(f"{name} must be {expected}, got {value!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE

    @property
    def penalized(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or bool(self.logit_bias))


def _integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _top_count(value) -> bool:
    return value is None or (_integer(value) and 0 <= value <= MAX_LOGPROBS)


def _within(value, bounds: tuple[float, float]) -> bool:
    return _number(value) and bounds[0] <= value <= bounds[1]


class Penalties:
    """What a row's penalties and bias read on one rank's slice of the vocabulary (token ids `tokens`): which of
    those tokens its prompt and output hold (repetition penalty), how often each is in its output (presence and
    frequency penalties), and its logit bias, as (len(tokens),) tensors."""

    def __init__(self, params: SamplingParams, prompt: list[int], tokens: range, device: torch.device):
        self.params, self.tokens = params, tokens
        self.seen = self.counts = self.bias = None
        if params.repetition_penalty != 1.0:
            self.seen = torch.zeros(len(tokens), dtype=torch.bool, device=device)
            self.seen[self._local(prompt)] = True
        if params.presence_penalty or params.frequency_penalty:
            self.counts = torch.zeros(len(tokens), device=device)
        if params.logit_bias:
            self.bias = torch.zeros(len(tokens), device=device)
            mine = [(t - tokens.start, b) for t, b in params.logit_bias if t in tokens]
            if mine:
                ids, values = zip(*mine)
                self.bias[torch.tensor(ids, device=device)] = torch.tensor(values, device=device)

    def _local(self, ids) -> torch.Tensor:
        return torch.tensor([t - self.tokens.start for t in ids if t in self.tokens], dtype=torch.long,
                            device=self.seen.device if self.seen is not None else None)

    def observe(self, token: int) -> None:
        """The row's output grew by `token`."""
        if token in self.tokens:
            if self.seen is not None:
                self.seen[token - self.tokens.start] = True
            if self.counts is not None:
                self.counts[token - self.tokens.start] += 1

    def apply(self, logits: torch.Tensor, ahead: tuple[int, ...] = ()) -> torch.Tensor:
        """logits (..., len(tokens)) as the row's penalties and bias leave them; `ahead`: tokens the output holds
        besides those observed (a speculative slot's: the proposals before it, had they been accepted)."""
        params, seen, counts = self.params, self.seen, self.counts
        if ahead:
            seen, counts = (None if seen is None else seen.clone()), (None if counts is None else counts.clone())
            for token in (t - self.tokens.start for t in ahead if t in self.tokens):
                if seen is not None:
                    seen[token] = True
                if counts is not None:
                    counts[token] += 1
        if self.bias is not None:
            logits = logits + self.bias
        if seen is not None:
            penalized = torch.where(logits > 0, logits / params.repetition_penalty,
                                    logits * params.repetition_penalty)
            logits = torch.where(seen, penalized, logits)
        if counts is not None:
            logits = logits - params.frequency_penalty * counts - params.presence_penalty * (counts > 0)
        return logits


@dataclass(frozen=True)
class Candidates:
    """What sampling reads of one row's next-token logits: the most likely tokens (`ids`, their adjusted logits
    `values` in descending order, ties by id: logit bias, penalties and a grammar's mask applied) and how many of
    them its sampling keeps (`kept`: `kept_counts`). For log-probabilities (else None): the raw logits of `ids`
    (`raw`), the raw log-sum-exp, and the raw logits' `top` most likely (ids, logits). Made by merging every rank's
    slice (vocab_slices.py)."""
    ids: torch.Tensor
    values: torch.Tensor
    kept: int
    raw: Optional[torch.Tensor] = None
    raw_lse: Optional[float] = None
    top_ids: Optional[torch.Tensor] = None
    top_values: Optional[torch.Tensor] = None


UNKNOWN = -1  # a kept count the candidates cannot tell


def kept_counts(values: torch.Tensor, lse: Optional[torch.Tensor], complete: bool,
                params: list[SamplingParams]) -> torch.Tensor:
    """(rows, L): how many of each row's candidates its sampling draws from, `values` (rows, L, k) their adjusted
    logits in descending order: min_p, top_k, then top_p keep a run of the most likely (vLLM's order), top_p's mass
    measured over what min_p and top_k keep. UNKNOWN where that run may reach past the candidates (more are needed
    to tell); 1 for greedy rows, and for rows whose logits are NaN or nowhere finite (sampling them fails).
    `lse` (rows, L): the log-sum-exp of each row's every adjusted logit over its temperature; `complete`: the
    candidates hold every token."""
    rows, k = values.shape[0], values.shape[-1]
    column = lambda xs, dtype=values.dtype: torch.tensor(xs, dtype=dtype).view(rows, 1)  # noqa: E731
    greedy = column([p.greedy for p in params], torch.bool)
    z = values / column([1.0 if p.greedy else p.temperature for p in params])[..., None]
    finite = z.isfinite().sum(dim=-1)
    whole = (finite < k) | complete  # sorted: past a -inf, every token's logit is -inf
    undecided = k + 1  # no cut
    min_p = column([p.min_p for p in params])
    within = (z - z[..., :1] >= min_p.clamp(min=1e-38).log()[..., None]).sum(dim=-1)
    min_cut = torch.where((min_p > 0) & ((within < k) | whole), within, undecided)
    top_k = column([p.top_k for p in params], torch.long)
    k_cut = torch.where((top_k > 0) & ((top_k <= k) | whole), top_k, undecided)
    cut = torch.minimum(min_cut, k_cut)
    decided = cut < undecided
    unknown = ~decided & ((min_p > 0) | (top_k > 0)) & ~whole
    cut = torch.where(decided, torch.minimum(cut, finite), finite)
    inside = torch.arange(k) < cut[..., None]
    cut_lse = torch.logsumexp(z.masked_fill(~inside, float("-inf")), dim=-1)
    normalizer = torch.where(decided, cut_lse, lse if lse is not None else cut_lse)
    probs = torch.exp(z - normalizer[..., None]).masked_fill(~inside, 0.0)
    top_p = column([p.top_p for p in params])
    past = ((probs.cumsum(dim=-1) - probs) > top_p[..., None]) & inside & (top_p < 1)[..., None]  # 1: rounding
    found = past.any(dim=-1)
    kept = torch.where(found, past.int().argmax(dim=-1), torch.where((cut < k) | whole, cut, UNKNOWN))
    kept = torch.where(unknown, UNKNOWN, kept)
    broken = ~z[..., 0].isfinite() | (normalizer.isnan() if lse is not None else False)
    return torch.where(greedy | broken, 1, kept)


def sample(c: Candidates, params: SamplingParams, generator: Optional[torch.Generator]) -> int:
    """A row's next token from its candidates: greedy argmax, or a draw among the `kept` most likely, in proportion
    to their probabilities, in the order the module's docstring gives."""
    first = float(c.values[0])
    if math.isnan(first):
        raise SamplingError(NAN_LOGITS)
    if params.greedy:
        return int(c.ids[0])
    if first == -math.inf:
        raise SamplingError("the probabilities are not a distribution (no token has a finite logit)")
    if c.kept == UNKNOWN:
        raise RuntimeError("sampling was given too few candidates for its parameters")
    weights = torch.exp((c.values[:c.kept] - c.values[0]) / params.temperature)
    return int(c.ids[int(torch.multinomial(weights, num_samples=1, generator=generator))])
