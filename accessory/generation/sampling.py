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
    """What a row's penalties and bias read: which tokens its prompt and output hold (repetition penalty), how
    often each is in its output (presence and frequency penalties), and its logit bias, as (vocab,) tensors."""

    def __init__(self, params: SamplingParams, prompt: list[int], vocab_size: int, device: torch.device):
        self.params = params
        self.seen = self.counts = self.bias = None
        if params.repetition_penalty != 1.0:
            self.seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            self.seen[torch.tensor([t for t in prompt if t < vocab_size], dtype=torch.long, device=device)] = True
        if params.presence_penalty or params.frequency_penalty:
            self.counts = torch.zeros(vocab_size, device=device)
        if params.logit_bias:
            self.bias = torch.zeros(vocab_size, device=device)
            ids, values = zip(*params.logit_bias)
            self.bias[torch.tensor(ids, device=device)] = torch.tensor(values, device=device)

    def observe(self, token: int) -> None:
        """The row's output grew by `token`."""
        if self.seen is not None:
            self.seen[token] = True
        if self.counts is not None:
            self.counts[token] += 1

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        params = self.params
        if self.bias is not None:
            logits = logits + self.bias
        if self.seen is not None:
            penalized = torch.where(logits > 0, logits / params.repetition_penalty,
                                    logits * params.repetition_penalty)
            logits = torch.where(self.seen, penalized, logits)
        if self.counts is not None:
            logits = logits - params.frequency_penalty * self.counts - params.presence_penalty * (self.counts > 0)
        return logits


def sample(logits: torch.Tensor, params: SamplingParams, generator: Optional[torch.Generator],
           penalties: Optional[Penalties] = None) -> torch.Tensor:
    """Next token per row from logits (B, vocab), in the order the module's docstring gives."""
    if penalties is not None:
        logits = penalties.apply(logits)
    if params.greedy:
        tokens, broken = greedy(logits)
        if broken.any():
            raise SamplingError(NAN_LOGITS)
        return tokens
    logits = logits / params.temperature
    if params.min_p > 0:  # log(p / p_max) < log(min_p)
        logits = logits.masked_fill(logits - logits.max(dim=-1, keepdim=True).values < math.log(params.min_p),
                                    float("-inf"))
    if 0 < params.top_k < logits.shape[-1]:
        kth = logits.topk(params.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        probs = _top_p_filter(probs, params.top_p)
    if not (probs.isfinite().all() and (probs.sum(dim=-1) > 0).all()):
        raise SamplingError("the probabilities are not a distribution (the logits hold NaN or no finite value)")
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)


def greedy(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The index of each row's largest logit (the first, on ties), and whether the row holds NaN (then no index is
    right): from `max(...)`, which torch computes about three times faster than `argmax` on the CPU."""
    best = logits.max(dim=-1)
    return best.indices, best.values.isnan()


def _top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p (always at least one)."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(mass_before > top_p, 0.0)
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs)  # multinomial renormalises
