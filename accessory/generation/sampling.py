"""Turning logits into the next token. Pure functions; randomness only from the generator passed in.

Sampling cannot fail on parameters that passed `SamplingParams`: a temperature below MIN_TEMPERATURE is greedy
(dividing by it would overflow), and penalties stay within REPETITION_PENALTY_RANGE. What remains, logits that are
not numbers (a broken model), raises SamplingError for that row alone.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

MIN_TEMPERATURE = 1e-5  # below this, sampling is greedy (as vLLM): logits / 1e-38 overflow float32
REPETITION_PENALTY_RANGE = (0.01, 100.0)  # beyond these, penalized logits reach inf
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

    def __post_init__(self):
        low, high = REPETITION_PENALTY_RANGE
        checks = {
            "max_gen_len": (self.max_gen_len, _integer(self.max_gen_len) and self.max_gen_len >= 1, "an integer >= 1"),
            "temperature": (self.temperature, _number(self.temperature) and self.temperature >= 0,
                            "a finite number >= 0"),
            "top_p": (self.top_p, _number(self.top_p) and 0 < self.top_p <= 1, "in (0, 1]"),
            "top_k": (self.top_k, _integer(self.top_k) and self.top_k >= 0, "an integer >= 0"),
            "repetition_penalty": (self.repetition_penalty,
                                   _number(self.repetition_penalty) and low <= self.repetition_penalty <= high,
                                   f"in [{low}, {high}]"),
        }
        for name, (value, ok, expected) in checks.items():
            if not ok:
                raise ValueError(f"{name} must be {expected}, got {value!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE


def _integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def sample(logits: torch.Tensor, params: SamplingParams, generator: Optional[torch.Generator],
           seen: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Next token per row from logits (B, vocab). `seen` (B, vocab) bool marks tokens the repetition penalty hits.

    Order as in HF transformers: repetition penalty, then greedy argmax, or temperature, top-k and top-p.
    """
    if params.repetition_penalty != 1.0 and seen is not None:
        penalized = torch.where(logits > 0, logits / params.repetition_penalty, logits * params.repetition_penalty)
        logits = torch.where(seen, penalized, logits)
    if params.greedy:
        tokens, broken = greedy(logits)
        if broken.any():
            raise SamplingError(NAN_LOGITS)
        return tokens
    logits = logits / params.temperature
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
