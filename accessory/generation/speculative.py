"""Speculative decoding: a cheap proposer guesses each row's next few tokens, and one step of the model scores the
row's next token and the guesses together (`Transformer.verify`), so a step can add several tokens for one read of
the weights.

Proposals are deterministic: an n-gram lookup in the row's own prompt and output (`NgramProposer`, no second model),
or a draft model's greedy tokens (draft.py). The source rank's scheduler samples the target's logits at each scored
position as plain decoding would, with the same parameters and generator, and keeps a proposal only when that sample
equals it; the first sample that differs is kept too, and ends the row's step. For a deterministic proposer this is
the standard acceptance rule (accept with probability p(x); on rejection, sample from p without x), so the output is
the target model's, greedy or sampled: with a seed, token for token what plain decoding gives.

What the configuration accepts is vLLM's `speculative_config`. Each row proposes as many tokens as pay for
themselves (`RowBudget`): from its acceptance rate so far and what the steps cost on this machine, measured.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Optional

import numpy as np

from accessory.errors import ConfigError
from accessory.untrusted import shown

METHODS = ("ngram", "draft_model")
QUANTS = ("int8", "int4")  # the draft's format, as from_pretrained's quant names it (or true: int8, false: float)
MAX_SPECULATIVE_TOKENS = 64  # a step scores this many proposals a row at most: more never pays, and costs memory
MAX_LOOKUP = 64  # n-gram lengths: the lookup compares each earlier occurrence over this many tokens
DECAY = 0.8  # a row's acceptance rate weighs each earlier verify step this much less than the next
PROBE_EVERY = 8  # where speculation does not pay, a row still proposes one token this often (in steps)


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `speculative_config`: `{"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": N,
    "prompt_lookup_min": M}` (proposals from the row's own tokens), or `{"model": PATH, "num_speculative_tokens":
    K}` (method "draft_model": a draft checkpoint with the same tokenizer, on the same ranks; `"model": "self"` is
    the target's own checkpoint, with `"quant"` its format, e.g. "int4": a float or int8 model drafts for itself).
    K: tokens proposed per step at most (1 to MAX_SPECULATIVE_TOKENS, and below max_seq_len: `check_window`)."""
    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    model: Optional[str] = None
    quant: Any = None

    def __post_init__(self):
        if not isinstance(self.method, str) or self.method not in METHODS:
            raise ConfigError(f"speculative_config method must be one of {METHODS}, got {shown(self.method)}")
        self._check_counts()
        self._check_draft()

    def _check_draft(self) -> None:
        if self.model is not None and (not isinstance(self.model, str) or not self.model or "\x00" in self.model):
            raise ConfigError(f'speculative_config model must be a checkpoint folder or "self", got '
                              f"{shown(self.model)}")
        if not (self.quant is None or isinstance(self.quant, bool) or (isinstance(self.quant, str)
                                                                       and self.quant in QUANTS)):
            raise ConfigError(f'speculative_config quant must be "int8", "int4", true (int8), false or null, got '
                              f"{shown(self.quant)}")
        if (self.method == "draft_model") != (self.model is not None):
            raise ConfigError('speculative_config: method "draft_model" needs "model" (a checkpoint, or "self"), '
                              'and "model" needs method "draft_model"')
        if self.quant is not None and self.model is None:
            raise ConfigError('speculative_config "quant" is the draft model\'s format: it needs "model"')

    def _check_counts(self) -> None:
        for name, most in (("num_speculative_tokens", MAX_SPECULATIVE_TOKENS), ("prompt_lookup_max", MAX_LOOKUP),
                           ("prompt_lookup_min", MAX_LOOKUP)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"speculative_config {name} must be an integer >= 1, got {shown(value)}")
            if value > most:
                raise ConfigError(f"speculative_config {name} must be at most {most}, got {shown(value)}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ConfigError(f"speculative_config prompt_lookup_min ({self.prompt_lookup_min}) must be at most "
                              f"prompt_lookup_max ({self.prompt_lookup_max})")

    def check_window(self, max_seq_len: int) -> None:
        """A step scores the next token and every proposal at once, all inside the max_seq_len window: refuse a
        num_speculative_tokens that cannot fit, before anything is allocated for it."""
        if self.num_speculative_tokens >= max_seq_len:
            raise ConfigError(f"speculative_config num_speculative_tokens ({self.num_speculative_tokens}) must be "
                              f"below max_seq_len ({max_seq_len}): a step scores the next token and every proposal "
                              f"within it")

    @classmethod
    def from_dict(cls, values: Optional[dict], source: str = "speculative_config") -> Optional["SpeculativeConfig"]:
        """The config a user wrote (a dict, e.g. parsed from --speculative-config's JSON), or None for none. With
        "model" and no "method", the method is "draft_model"."""
        if values is None or isinstance(values, SpeculativeConfig):
            return values
        if not isinstance(values, dict):
            raise ConfigError(f"{source} must be a JSON object, got {type(values).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted((key for key in values if key not in known), key=str)
        if unknown:
            raise ConfigError(f"{source}: unknown key(s) {shown(unknown, 200)}; known: {sorted(known)}")
        if "model" in values and "method" not in values:
            values = {**values, "method": "draft_model"}
        return cls(**values)


class NgramProposer:
    """Prompt lookup: find the row's last n tokens (n from prompt_lookup_max down to prompt_lookup_min) earlier in
    its prompt and output, and propose what followed their latest earlier occurrence. It reads only the tokens every
    rank holds, so every rank proposes the same without a message."""

    def __init__(self, config: SpeculativeConfig):
        self.longest, self.shortest = config.prompt_lookup_max, config.prompt_lookup_min

    def propose(self, target, tokens: tuple[int, ...], limits: list[int]) -> list[tuple[int, ...]]:
        """Up to limits[row] tokens to follow what each row of `target` (the target's ModelRunner) holds and its
        next token."""
        return [self.lookup([*row, token], limit) if limit else ()
                for row, token, limit in zip(target.cached, tokens, limits)]

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

    def admit(self, prompts, images, target) -> None:
        """Rows joined the target's runner (nothing kept per row here)."""


@dataclass
class RowBudget:
    """How many tokens a row proposes next: the count with the most tokens expected per unit of time. `costs[k]` is
    what a step that proposes and scores k tokens costs, relative to a plain decode step (costs[0] = 1; measured by
    the engine, `Speculation.costs`); each proposal is taken to be accepted with probability p, the row's
    rate so far (decayed counts, from an even prior), so k proposals add 1 + p + ... + p^k tokens. Where no count
    pays (p low, or steps that score more tokens dear), the row proposes nothing, but one token every PROBE_EVERY
    steps, so that text that turns guessable is noticed; and at its first step, where the even prior alone would
    keep a row whose steps cost half a decode step more from proposing for PROBE_EVERY steps. Updated alike on
    every rank, from the tokens each step kept, with costs the source rank measured: every rank's rows propose
    alike."""
    costs: tuple[float, ...]
    accepted: float = 1.0
    rejected: float = 1.0
    waited: int = PROBE_EVERY - 1  # steps without proposing since the last probe (a new row probes at once)

    @property
    def rate(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def next(self) -> int:
        size = best_size(self.rate, self.costs)
        if size:
            self.waited = 0
            return size
        self.waited += 1
        if self.waited < PROBE_EVERY:
            return 0
        self.waited = 0
        return 1

    def observe(self, proposed: int, accepted: int) -> None:
        """A step scored `proposed` of the row's tokens and kept the first `accepted`."""
        if proposed:
            self.accepted = DECAY * self.accepted + accepted
            self.rejected = DECAY * self.rejected + (accepted < proposed)


def best_size(rate: float, costs: tuple[float, ...]) -> int:
    """The k in 0..len(costs)-1 that maximizes the tokens expected, 1 + rate + ... + rate^k, over costs[k]."""
    expected, term, best, best_gain = 1.0, 1.0, 0, 1.0 / costs[0]
    for k in range(1, len(costs)):
        term *= rate
        expected += term
        if expected / costs[k] > best_gain * (1 + 1e-9):
            best, best_gain = k, expected / costs[k]
    return best


def accepted_count(proposed: tuple[int, ...], kept: tuple[int, ...]) -> int:
    """How many of a row's proposals a step kept: the tokens it kept start with them (the first that differs, or
    the one after the last proposal, follows)."""
    count = 0
    for guess, token in zip(proposed, kept):
        if guess != token:
            break
        count += 1
    return count
