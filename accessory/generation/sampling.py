"""Turning logits into the next token. Pure functions; randomness only from the generator passed in."""
from __future__ import annotations

from typing import Optional

import torch


def sample(logits: torch.Tensor, temperature: float, top_p: float,
           generator: Optional[torch.Generator]) -> torch.Tensor:
    """Next token per row from logits (B, vocab): argmax at temperature 0, else nucleus (top_p) sampling."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        probs = _top_p_filter(probs, top_p)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)


def _top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p (always at least one)."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(mass_before > top_p, 0.0)
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs)  # multinomial renormalises
