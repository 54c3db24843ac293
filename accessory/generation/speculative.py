"""Speculative decoding: a cheap proposer guesses each row's next few tokens, and one step of the model scores the
row's next token and the guesses together (`Transformer.verify`), so a step can add several tokens for one read of
the weights.

Proposals are deterministic: an n-gram lookup in the row's own prompt and output (`NgramProposer`, no second model),
or a draft model's greedy tokens (draft.py). The source rank's scheduler samples the target's logits at each scored
position as plain decoding would, with the same parameters and generator, and keeps a proposal only when that sample
equals it; the first sample that differs is kept too, and ends the row's step. For a deterministic proposer this is
the standard acceptance rule (accept with probability p(x); on rejection, sample from p without x), so the output is
the target model's, greedy or sampled: with a seed, token for token what plain decoding gives.

What the configuration accepts is vLLM's `speculative_config`; the rows' back-off (`RowBudget`) keeps speculation
cheap where proposals are rarely accepted.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Optional

import numpy as np

from accessory.errors import ConfigError

METHODS = ("ngram", "draft_model")
MAX_COOLDOWN = 16  # steps a row waits before proposing again, at most, after proposals that all failed


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `speculative_config`: `{"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": N,
    "prompt_lookup_min": M}` (proposals from the row's own tokens), or `{"model": PATH, "num_speculative_tokens":
    K}` (method "draft_model": a draft checkpoint with the same tokenizer, on the same ranks; `"model": "self"` is
    the target's own checkpoint, with `"quant"` its format, e.g. "int4": a float or int8 model drafts for itself).
    K: tokens proposed per step at most."""
    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    model: Optional[str] = None
    quant: Any = None

    def __post_init__(self):
        if self.method not in METHODS:
            raise ConfigError(f"speculative_config method must be one of {METHODS}, got {self.method!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"speculative_config {name} must be an integer >= 1, got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ConfigError(f"speculative_config prompt_lookup_min ({self.prompt_lookup_min}) must be at most "
                              f"prompt_lookup_max ({self.prompt_lookup_max})")
        if (self.method == "draft_model") != (self.model is not None):
            raise ConfigError('speculative_config: method "draft_model" needs "model" (a checkpoint, or "self"), '
                              'and "model" needs method "draft_model"')
        if self.quant is not None and self.model is None:
            raise ConfigError('speculative_config "quant" is the draft model\'s format: it needs "model"')

    @classmethod
    def from_dict(cls, values: Optional[dict], source: str = "speculative_config") -> Optional["SpeculativeConfig"]:
        """The config a user wrote (a dict, e.g. parsed from --speculative-config's JSON), or None for none. With
        "model" and no "method", the method is "draft_model"."""
        if values is None or isinstance(values, SpeculativeConfig):
            return values
        if not isinstance(values, dict):
            raise ConfigError(f"{source} must be a JSON object, got {type(values).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"{source}: unknown key(s) {unknown}; known: {sorted(known)}")
        if "model" in values and "method" not in values:
            values = {**values, "method": "draft_model"}
        return cls(**values)


class NgramProposer:
    """Prompt lookup: find the row's last n tokens (n from prompt_lookup_max down to prompt_lookup_min) earlier in
    its prompt and output, and propose what followed their latest earlier occurrence. It reads only the tokens every
    rank holds, so every rank proposes the same without a message."""

    def __init__(self, config: SpeculativeConfig):
        self.longest, self.shortest = config.prompt_lookup_max, config.prompt_lookup_min

    def propose(self, cached: list[list[int]], tokens: tuple[int, ...], limits: list[int]) -> list[tuple[int, ...]]:
        """Up to limits[row] tokens to follow each row's `cached` tokens and its next token."""
        return [self.lookup([*row, token], limit) if limit else ()
                for row, token, limit in zip(cached, tokens, limits)]

    def lookup(self, history: list[int], limit: int) -> tuple[int, ...]:
        """Up to `limit` tokens that followed the longest match of history's end (the latest, among equals)."""
        tokens = np.asarray(history)
        ends = np.flatnonzero(tokens[:-1] == tokens[-1])  # earlier positions holding the last token
        if len(ends) == 0:
            return ()
        longest = min(self.longest, len(tokens) - 1)
        back = np.arange(longest)  # compare tokens[end - j] with tokens[-1 - j], j < longest
        earlier = tokens[np.clip(ends[:, None] - back, 0, None)]
        same = (earlier == tokens[-1 - back]) & (ends[:, None] - back >= 0)
        matched = np.cumprod(same, axis=1).sum(axis=1)  # each occurrence's match length
        best = int(matched.max())
        if best < self.shortest:
            return ()
        end = int(ends[np.flatnonzero(matched == best)[-1]])
        return tuple(int(t) for t in tokens[end + 1:end + 1 + limit])

    def compact(self, keep: tuple[int, ...]) -> None:
        """Rows moved (nothing kept per row here)."""

    def admit(self, prompts, images) -> None:
        """Rows joined (nothing kept per row here)."""


@dataclass
class RowBudget:
    """How many tokens a row may propose next: up to K, one more after a step that accepted every proposal, one
    fewer after one that did not. After a step that accepted none, the row pauses `cooldown` steps (doubling with
    each such step in a row, up to MAX_COOLDOWN) before proposing again, so text that the proposer cannot guess
    costs few verify steps. Updated alike on every rank, from the tokens each step kept."""
    most: int
    size: int = 0
    misses: int = 0
    cooldown: int = 0

    def __post_init__(self):
        self.size = self.size or self.most

    def next(self) -> int:
        if self.cooldown:
            self.cooldown -= 1
            return 0
        return self.size

    def observe(self, proposed: int, accepted: int) -> None:
        if not proposed:
            return
        self.size = min(self.most, self.size + 1) if accepted == proposed else max(1, self.size - 1)
        if accepted:
            self.misses = 0
        else:
            self.misses += 1
            self.cooldown = min(MAX_COOLDOWN, 2 ** (self.misses - 1))


def accepted_count(proposed: tuple[int, ...], kept: tuple[int, ...]) -> int:
    """How many of a row's proposals a step kept: the tokens it kept start with them (the first that differs, or
    the one after the last proposal, follows)."""
    count = 0
    for guess, token in zip(proposed, kept):
        if guess != token:
            break
        count += 1
    return count
