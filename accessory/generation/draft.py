"""A draft model's proposals for speculative decoding (speculative.py says how they are used): a smaller model, or
the target itself loaded quantized, on the same ranks and tokenizer, keeps KV-cache rows that mirror the target's
(`ModelRunner` of its own: the same compaction, prefills and prefix reuse) and proposes its greedy tokens. The
target's own weights as the draft (`"model": "self"`) prefill nothing: a joining prompt's keys and values are
copied from the target's cache, which has the same layout (`ModelRunner.adopt`), so speculation adds nothing to
the time to the first token.

Each step, a row first catches up on what the target kept since the draft last ran (the target's next token, and
the last proposal when all were accepted: `pending`), in one pass; then one pass per further proposal. The
self-draft copies the keys and values of all but the target's next token from the target instead (`_follow`), so
its first pass is one token too, and a row that proposes nothing for a while costs nothing to bring back. Every
rank runs the same passes; each pass's greedy tokens are read from the logits gathered over the ranks, so every
rank proposes the same.
"""
from __future__ import annotations

from typing import Optional

import torch

from accessory.generation.model_runner import ModelRunner
from accessory.generation.vocab_slices import slice_argmax


class DraftProposer:
    """The draft's side of one engine run: `draft` (its Engine), rows and columns as the target's runner has."""

    def __init__(self, draft, rows: int, columns: int, keep_finished: bool, vocab_size: int, most: int,
                 adopts: bool = False):
        """`adopts`: the draft is the target's own weights, whose keys and values it takes (`admit`); it then keeps
        no finished rows for prefix reuse, since it never prefills."""
        self.runner = ModelRunner(draft, rows, columns, keep_finished and not adopts)
        self.most = most  # proposals per step at most: a row's last `most` fed tokens may be rejected ones
        self.vocab_size = vocab_size  # the ids the target samples from: the draft proposes only those
        self.adopts = adopts
        self._follows: Optional[bool] = None

    def follows(self, target: ModelRunner) -> bool:
        """Whether this draft takes `target`'s keys and values (the self-draft, with a cache of the same layout)."""
        if self._follows is None:
            self._follows = self.adopts and self.runner.mirrors(target)
        return self._follows

    @torch.inference_mode()
    def propose(self, target: ModelRunner, tokens: tuple[int, ...], limits: list[int]) -> list[tuple[int, ...]]:
        """Up to limits[row] greedy tokens of the draft after what each row of `target` (the target's runner)
        holds and its next token."""
        held = self.runner.cached
        if self.follows(target):
            pending = self._follow(target, tokens, limits)
        else:  # every row catches up, so that none falls further behind
            pending = [tuple(pending_tokens(draft, [*row, token], self.most + 1))
                       for draft, row, token in zip(held, target.cached, tokens)]
        logits = self.runner.feed(pending)  # (rows, L, local vocab)
        last = torch.tensor([max(len(p), 1) - 1 for p in pending], device=logits.device)
        guesses = self._greedy(logits[torch.arange(len(pending), device=logits.device), last])
        proposals = [[guess] for guess in guesses]
        for step in range(1, max(limits)):
            more = [limit > step and len(draft) < self.runner.columns for limit, draft in zip(limits, held)]
            logits = self.runner.feed([(guess,) if go else () for guess, go in zip(guesses, more)])
            guesses = self._greedy(logits[:, 0])
            for row, guess in enumerate(guesses):
                proposals[row].append(guess)
        return [tuple(p[:limit]) for p, limit in zip(proposals, limits)]

    def _follow(self, target: ModelRunner, tokens: tuple[int, ...], limits: list[int]) -> list[tuple[int, ...]]:
        """The self-draft's catch-up: each proposing row takes the keys and values of what the target's row holds
        and it lacks (after cutting the proposals the target rejected) from the target's cache, which has the same
        layout; what is left to feed is the target's next token. Rows that propose nothing are left behind."""
        rows, start, end = [], self.runner.columns, 0
        for row, (draft, theirs, limit) in enumerate(zip(self.runner.cached, target.cached, limits)):
            if limit:
                lacking = pending_tokens(draft, theirs, self.most + 1)
                rows.append(row)
                start, end = min(start, len(draft)), max(end, len(theirs))
                draft += lacking
        if rows and start < end:  # one copy for all: a column past a row's end is rewritten before it is read
            self.runner.copy_columns(target, rows, start, end)
        return [(token,) if limit else () for token, limit in zip(tokens, limits)]

    def _greedy(self, local: torch.Tensor) -> list[int]:
        """The argmax over the whole vocabulary of each row's logits, of which this rank holds `local` (rows, its
        slice): the same on every rank."""
        mine = self.runner.engine.vocab_slice()[0]
        within = range(mine.start, max(mine.start, min(mine.stop, self.vocab_size)))  # the ids the target samples
        return slice_argmax(self.runner.engine.ctx, local, within)

    def compact(self, keep: tuple[int, ...]) -> None:
        self.runner.compact(keep)

    def admit(self, prompts, images, target: ModelRunner) -> None:
        """Prompts joined the `target` runner's rows: the draft's mirror rows take them too."""
        if self.follows(target):
            self.runner.adopt(prompts, images, target)
        else:
            self.runner.prefill(prompts, images)


def pending_tokens(draft: list[int], target: list[int], reach: int) -> list[int]:
    """The tokens at the end of `target` that the draft's row (holding `draft`) lacks, after cutting from `draft`
    what differs from `target` (proposals the target rejected): those are among the draft's last `reach` tokens."""
    same = max(0, min(len(draft), len(target)) - reach)
    while same < min(len(draft), len(target)) and draft[same] == target[same]:
        same += 1
    del draft[same:]
    return target[same:]
