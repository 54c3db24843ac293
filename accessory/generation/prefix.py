"""Prefix caching: a prompt that starts with tokens already in the KV cache (a shared system prompt, the earlier
turns of a chat) copies their keys and values from the row that holds them instead of recomputing them.

Every rank keeps the same record of what each cache row holds, built from the plans alone (the prompts admitted and
each step's tokens), so every rank makes the same choices by itself: nothing more is sent between ranks. A row
holds what was fed through the model: its prompt, then each token decoded (not the last token sampled, which was
never fed). Sources are the live rows, the prompts admitted earlier in the same step, and finished sequences kept
in a few extra cache rows (`RetainedRows`, least recently used evicted first).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

# Shorter shared prefixes (the BOS token, a chat template's first header) are not reused: they save less compute
# than the copies cost, and a prompt reusing one from a prompt admitted in the same step waits for its prefill.
MIN_REUSE = 16


@dataclass(frozen=True)
class Reuse:
    """Copy cache columns 0..length-1 of row `source`; `after`: the index of the prompt admitted in the same step
    that must be prefilled first (it writes the source row), or None."""
    source: int
    length: int
    after: Optional[int] = None


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists (slices compared in C, halving the range)."""
    low, high = 0, min(len(a), len(b))
    while low < high:
        middle = (low + high + 1) // 2
        if a[low:middle] == b[low:middle]:
            low = middle
        else:
            high = middle - 1
    return low


class RetainedRows:
    """Finished sequences kept in cache rows first..first+count-1 for later prompts to reuse."""

    def __init__(self, first: int, count: int):
        self.first = first
        self.tokens: list[Optional[list[int]]] = [None] * count  # what each slot's row holds
        self.order = list(range(count))  # slots, least recently used first

    def candidates(self) -> list[tuple[int, list[int]]]:
        """(cache row, tokens) of every kept sequence."""
        return [(self.first + slot, tokens) for slot, tokens in enumerate(self.tokens) if tokens is not None]

    def keep(self, tokens: list[int]) -> Optional[int]:
        """The cache row a finished sequence holding `tokens` is to be copied to, or None to keep nothing: one
        already kept covers it. A kept sequence that `tokens` extends (the chat's previous turn) gives up its slot;
        otherwise an empty slot, else the least recently used."""
        if not self.tokens or len(tokens) < MIN_REUSE:
            return None
        shared = [(slot, common_prefix(kept, tokens), len(kept)) for slot, kept in enumerate(self.tokens)
                  if kept is not None]
        covering = [slot for slot, length, _ in shared if length == len(tokens)]
        if covering:
            self.used(self.first + covering[0])
            return None
        extended = [slot for slot, length, held in shared if length == held]
        empty = [slot for slot, kept in enumerate(self.tokens) if kept is None]
        slot = (extended or empty or self.order)[0]
        self.tokens[slot] = tokens
        self.used(self.first + slot)
        return self.first + slot

    def used(self, row: int) -> None:
        """Mark the slot at cache row `row` (if it is one) as the most recently used."""
        slot = row - self.first
        if 0 <= slot < len(self.tokens):
            self.order.remove(slot)
            self.order.append(slot)


def plan_reuse(prompts: Sequence[list[int]], live: Sequence[list[int]], retained: RetainedRows,
               usable: Callable[[int, int], int] = lambda length, held: length) -> list[Optional[Reuse]]:
    """For each prompt admitted into rows len(live), len(live)+1, ...: where to copy its longest cached prefix
    from (a live row, a kept sequence, or a prompt before it in `prompts`), or None. At least the prompt's last
    token is always recomputed: its logits are needed. `usable(length, held)`: how much of a shared prefix of
    `length` tokens a row holding `held` tokens can give (`KVCaches.reusable_prefix`: a sliding-window layer's
    ring keeps only a row's last positions)."""
    sources = [(row, tokens, None) for row, tokens in enumerate(live)]
    sources += [(row, tokens, None) for row, tokens in retained.candidates()]
    plans = []
    for i, prompt in enumerate(prompts):
        best = None
        for row, tokens, after in sources:
            length = usable(min(common_prefix(prompt, tokens), len(prompt) - 1), len(tokens))
            if length >= MIN_REUSE and (best is None or length > best.length):
                best = Reuse(row, length, after)
        plans.append(best)
        sources.append((len(live) + i, prompt, i))
    return plans


def waves(plans: Sequence[Optional[Reuse]]) -> list[list[int]]:
    """Indices of the prompts in prefill order: each wave's prompts reuse only rows written before it."""
    level: list[int] = []
    for plan in plans:
        level.append(0 if plan is None or plan.after is None else level[plan.after] + 1)
    return [[i for i, lv in enumerate(level) if lv == wave] for wave in range(max(level, default=-1) + 1)]
