"""One generation step as the source rank decided it: scheduler.py writes it, wire.py carries it to the other ranks,
model_runner.py runs it on every rank, and a scheduler's Follower turns it into the same events."""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

from accessory.generation.vocab_slices import RowRule


class RowResult(NamedTuple):
    """What the last step did to one of its rows."""
    tokens: tuple[int, ...]  # the tokens that joined the row's text: one, up to 1 + its proposals, or none
    finish: int  # the FINISH_CODES of how the row ended, 0 while it goes on


@dataclass(frozen=True, kw_only=True)
class Joining:
    """The prompts that join the batch after the kept rows, each with what its row runs with."""
    prompts: tuple[tuple[int, ...], ...] = ()  # token ids
    ids: tuple = ()  # their requests' ids: a Follower needs them to write the same events
    images: tuple[Optional[torch.Tensor], ...] = ()  # each prompt's image's pixels, or None; empty when none has one
    adapters: tuple[int, ...] = ()  # each prompt's PEFT adapter (Request.adapter); empty when all are 0
    rules: tuple[RowRule, ...] = ()  # each prompt's sampling, which every rank applies to its vocabulary slice

    def __len__(self) -> int:
        return len(self.prompts)

    def each_image(self) -> tuple[Optional[torch.Tensor], ...]:
        return self.images or (None,) * len(self.prompts)


@dataclass(frozen=True, kw_only=True)
class Plan:
    """`keep[j]` is the current row that becomes row j (rows not named have finished), `tokens[j]` its next input
    token; `joining` the prompts whose rows follow them; `score`: prompts whose logits at every position the source
    rank wants (prompt log-probabilities); `results`: what the last step did to each of its rows; `done`: nothing
    is left, the run ends."""
    keep: tuple[int, ...] = ()
    tokens: tuple[int, ...] = ()
    joining: Joining = Joining()
    score: tuple[tuple[int, ...], ...] = ()
    results: tuple[RowResult, ...] = ()
    done: bool = False

    @property
    def rows(self) -> int:
        """The batch's rows after this step's changes."""
        return len(self.keep) + len(self.joining)

    @property
    def moves(self) -> bool:
        """Whether rows change places or join, or prompts are scored (else the kept rows are simply the first
        len(keep), and nothing more is sent)."""
        return bool(self.joining) or bool(self.score) or self.keep != tuple(range(len(self.keep)))
