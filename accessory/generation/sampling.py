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
    `values` in descending order, ties by id: logit bias, penalties and a grammar's mask applied), the log-sum-exp
    `lse` of every adjusted logit over the temperature, and whether the ids hold every token with a finite logit
    (`complete`). For log-probabilities (else None): the raw logits of `ids` (`raw`), the raw log-sum-exp, and
    the raw logits' `top` most likely (ids, logits). Made by merging every rank's slice (vocab_slices.py)."""
    ids: torch.Tensor
    values: torch.Tensor
    lse: float
    complete: bool
    raw: Optional[torch.Tensor] = None
    raw_lse: Optional[float] = None
    top_ids: Optional[torch.Tensor] = None
    top_values: Optional[torch.Tensor] = None


def kept_count(c: Candidates, params: SamplingParams) -> Optional[int]:
    """How many of the candidates a sampled row draws from (min_p, top_k, then top_p keep a run of the most
    likely, as vLLM orders them); None when that run may reach past them (more are needed to tell)."""
    z = c.values / params.temperature
    finite = int(z.isfinite().sum())
    complete = c.complete or finite < len(z)  # sorted: past a -inf, every token's logit is -inf
    cut = None  # how many min_p and top_k keep, when the candidates tell
    if params.min_p > 0:
        within = int((z[:finite] - z[0] >= math.log(params.min_p)).sum())
        if within < len(z) or complete:
            cut = within
    if params.top_k > 0 and (params.top_k <= len(z) or complete):
        cut = min(params.top_k, cut if cut is not None else params.top_k)
    if cut is None and (params.min_p > 0 or params.top_k > 0) and not complete:
        return None
    if cut is not None:
        cut = min(cut, finite)
        lse = torch.logsumexp(z[:cut], dim=0)
    else:  # every token stays: the normalizer is the whole vocabulary's
        cut, lse = finite, torch.tensor(c.lse)
    if params.top_p >= 1.0:
        return cut if cut < len(z) or complete else None
    probs = torch.exp(z[:cut] - lse)
    past = ((probs.cumsum(0) - probs) > params.top_p).nonzero()
    if len(past):
        return int(past[0])
    return cut if cut < len(z) or complete else None


def sample(c: Candidates, params: SamplingParams, generator: Optional[torch.Generator]) -> int:
    """A row's next token from its candidates: greedy argmax, or a draw among those `kept_count` keeps, in the
    order the module's docstring gives."""
    first = float(c.values[0])
    if math.isnan(first) or math.isnan(c.lse):
        raise SamplingError(NAN_LOGITS)
    if params.greedy:
        return int(c.ids[0])
    if first == -math.inf:
        raise SamplingError("the probabilities are not a distribution (no token has a finite logit)")
    kept = kept_count(c, params)
    if kept is None:
        raise RuntimeError("sampling was given too few candidates for its parameters")
    weights = torch.exp((c.values[:kept] - c.values[0]) / params.temperature)
    return int(c.ids[int(torch.multinomial(weights, num_samples=1, generator=generator))])

