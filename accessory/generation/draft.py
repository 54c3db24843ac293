"""A draft model's proposals for speculative decoding (speculative.py says how they are used): a smaller model, or
the target itself loaded quantized, on the same ranks and tokenizer, keeps KV-cache rows that mirror the target's
(`ModelRunner` of its own: the same compaction, prefills and prefix reuse) and proposes its greedy tokens. The
target's own weights as the draft (`"model": "self"`) prefill nothing: a joining prompt's keys and values are
copied from the target's cache, which has the same layout (`ModelRunner.adopt`), so speculation adds nothing to
the time to the first token.

Each step, a row first catches up on what the target kept since the draft last ran (the target's next token, and
the last proposal when all were accepted: `pending`), in one pass; then one pass per further proposal. Every rank
runs the same passes; each pass's greedy tokens are read from the logits gathered over the ranks, so every rank
proposes the same.
"""
from __future__ import annotations

import torch

from accessory.generation.model_runner import ModelRunner


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

    @torch.inference_mode()
    def propose(self, cached: list[list[int]], tokens: tuple[int, ...], limits: list[int]) -> list[tuple[int, ...]]:
        """Up to limits[row] greedy tokens of the draft after each target row's `cached` tokens and its next token."""
        held = self.runner.cached
        pending = [pending_tokens(draft, [*target, token], self.most + 1)
                   for draft, target, token in zip(held, cached, tokens)]
        proposals = [[] for _ in tokens]
        logits = self.runner.feed([tuple(p) for p in pending])  # (rows, L, local vocab)
        last = torch.tensor([len(p) - 1 for p in pending], device=logits.device)
        guesses = self._greedy(logits[torch.arange(len(pending), device=logits.device), last])
        for step in range(max(limits)):
            for row, guess in enumerate(guesses):
                proposals[row].append(guess)
            if step + 1 == max(limits):
                break
            room = [len(draft) < self.runner.columns for draft in held]
            logits = self.runner.feed([(guess,) if fits else () for guess, fits in zip(guesses, room)])
            guesses = self._greedy(logits[:, 0])
        return [tuple(p[:limit]) for p, limit in zip(proposals, limits)]

    def _greedy(self, local: torch.Tensor) -> list[int]:
        """The argmax over the whole vocabulary of each row's logits, of which this rank holds `local` (rows, its
        slice): the same on every rank."""
        full = self.runner.engine.ctx.all_gather(local, dim=-1)[:, :self.vocab_size]
        return full.argmax(dim=-1).tolist()

    def compact(self, keep: tuple[int, ...]) -> None:
        self.runner.compact(keep)

    def admit(self, prompts, images, target: ModelRunner) -> None:
        """Prompts joined the `target` runner's rows: the draft's mirror rows take them too."""
        if self.adopts and self.runner.mirrors(target):
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
