"""Continuous batching in lockstep: every model-parallel rank runs the same steps, the source rank decides them.

Each step the source rank's `Scheduler` turns the last step's logits into tokens, text and events, and writes a
`Plan`: which rows stay (a finished row's cache row is refilled by a live one), the next token of each, and the
prompts that join. The plan is broadcast, and every rank's `Batch` executes it. So ranks agree by construction
(no rank samples but the source; no caller has to seed every rank alike), and a request that arrives while others
decode joins the running batch at the next step.

A row's token at position p lives in KV-cache column p: rows at different positions share one cache, nothing is
padded, and a row that leaves frees its cache row at once.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import torch


@dataclass
class Plan:
    """One step, as the source rank decided it. `keep[j]` is the current row that becomes row j (rows not named
    have finished), `tokens[j]` its next input token; `admit` are the prompts (token ids) of rows that join after
    them. `events` carry what callers see of the previous step, so every rank can yield the same stream."""
    keep: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    admit: list[list[int]] = field(default_factory=list)
    events: list[tuple[Any, dict]] = field(default_factory=list)
    done: bool = False  # the last plan: nothing to run, the loop ends
    error: Optional[str] = None  # the source rank failed; every rank raises this

    @property
    def runs(self) -> bool:
        return bool(self.keep or self.admit)


class Batch:
    """The rows in flight on this rank: their KV-cache rows (0..len-1, in order) and positions."""

    def __init__(self, model, rows: int, columns: int):
        self.model, self.rows, self.columns = model, rows, columns
        self.positions: list[int] = []  # next position of each row = tokens cached so far
        model.setup_caches(rows, columns)
        self.device = model.rotations.device

    def step(self, plan: Plan) -> Optional[torch.Tensor]:
        """Run `plan`: logits (rows after the step, vocab) for each row's next token, or None if no rows run."""
        self._compact(plan.keep)
        if len(plan.keep) + len(plan.admit) > self.rows:
            raise RuntimeError(f"plan has {len(plan.keep) + len(plan.admit)} rows; the batch holds {self.rows}")
        logits = []
        if plan.keep:
            logits.append(self._decode(plan.tokens))
        if plan.admit:
            logits.append(self._prefill(plan.admit))
        return torch.cat(logits) if logits else None

    def _compact(self, keep: list[int]) -> None:
        moves = [(dst, src) for dst, src in enumerate(keep) if dst != src]
        if moves:
            end = max(self.positions[src] for _, src in moves)
            self.model.move_cache_rows([d for d, _ in moves], [s for _, s in moves], end)
        self.positions = [self.positions[src] for src in keep]

    def _decode(self, tokens: list[int]) -> torch.Tensor:
        batch = len(tokens)
        positions = torch.tensor(self.positions, device=self.device)[:, None]
        inputs = torch.tensor(tokens, dtype=torch.long, device=self.device)[:, None]
        logits = self.model(inputs, positions, slice(0, batch), torch.zeros(batch, dtype=torch.long,
                                                                              device=self.device))
        self.positions = [p + 1 for p in self.positions]
        return logits

    def _prefill(self, prompts: list[list[int]]) -> torch.Tensor:
        # Right-padded: padding only follows a row's real tokens, so causal attention never lets them see it, and
        # the padding's cache columns are overwritten by the row's own next tokens before anything reads them.
        start, lengths = len(self.positions), [len(p) for p in prompts]
        if min(lengths) < 1 or max(lengths) >= self.columns:
            raise ValueError(f"prompt lengths {lengths} must be in 1..{self.columns - 1} (the cache's columns)")
        inputs = torch.zeros(len(prompts), max(lengths), dtype=torch.long, device=self.device)
        for row, prompt in enumerate(prompts):
            inputs[row, :len(prompt)] = torch.tensor(prompt, dtype=torch.long)
        last = torch.tensor(lengths, device=self.device) - 1
        logits = self.model(inputs, None, slice(start, start + len(prompts)), last)
        self.positions += lengths
        return logits


def lockstep(model, ctx, scheduler, rows: int, columns: int, keep_cache_bytes: int = 0) -> Iterator[Plan]:
    """Run plans until the last one, on every rank; yield each plan (its events) before running it.

    `scheduler` is the source rank's (None elsewhere): `scheduler.plan(logits)` gives the next Plan from the
    last step's logits. If the source rank fails, the others hear of it in the next plan and raise too.
    """
    batch = Batch(model, rows, columns)
    logits = None
    try:
        while True:
            plan = _next_plan(scheduler, logits) if ctx.is_source else None
            plan = ctx.broadcast_object(plan)
            if plan.error is not None:
                if scheduler is not None and scheduler.error is not None:
                    raise scheduler.error
                raise RuntimeError(f"model-parallel source rank failed: {plan.error}")
            yield plan
            if plan.done:
                return
            logits = batch.step(plan)
    finally:
        if model.cache_nbytes > keep_cache_bytes:
            model.free_caches()


def _next_plan(scheduler, logits) -> Plan:
    try:
        return scheduler.plan(logits)
    except BaseException as e:  # tell the other ranks before raising, so they do not wait forever
        scheduler.error = e
        return Plan(done=True, error=f"{type(e).__name__}: {e}")
