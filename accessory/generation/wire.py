"""What the model-parallel ranks tell each other at each generation step, so that every rank runs the source rank's
plan (engine.py calls `share_plan` once a step; at one rank nothing is sent).

Each step the ranks add up one small integer tensor of fixed size, the step header: the source rank's fields (the
others add zeros) say the step's status, how many rows stay, whether rows move, and each row's token and finish
code (with speculative decoding, up to `width` tokens a row); one slot per rank holds that rank's place (which generation call, which step), so every rank checks that all
are at the same step (RanksDisagree if not, or if a rank does not come within the context's timeout_s). Only when
the batch changes (a row leaves from the middle, prompts join) does a second message carry which rows stay and the
new prompts' token ids; and only when the source rank has events the other ranks' Followers cannot write from the
tokens (an error's message, log-probabilities) does another carry those. No text is sent, and nothing sent per step
grows with the length of the output.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable, Optional

import torch

from accessory.errors import CollectivesOutOfStep, RanksDisagree
from accessory.generation.plan import Plan, RowResult
from accessory.parallel.watchdog import announce_failure, await_verdict_on_silent_ranks

RUN, DONE, FAILED = 0, 1, 2  # the status of a step, as sent
# The header's first fields (the source rank's; the others add zeros): then each stepped row's finish code, how many
# tokens it kept, `width` slots for those tokens, and one slot per rank for its place.
STATUS, KEPT, MOVES, EXTRAS, STEPPED, HEADER = range(6)


def header_started(ctx, rows: int, call: int, step: int, width: int = 1) -> Optional[Callable[[], torch.Tensor]]:
    """On a rank other than the source, its share of step `step`'s header (its place alone) sent ahead, where the
    header goes point to point (`ParallelContext.sum_started`): a later pipeline stage computes while the source rank
    plans. For `share_plan`'s `started`; None where it cannot start ahead."""
    place = call << 32 | step
    return ctx.sum_started(_header(ctx, None, None, rows, (), place, width))


def share_plan(ctx, plan: Optional[Plan], error: Optional[Exception], rows: int, extras: tuple, call: int,
               step: int, width: int = 1, started: Optional[Callable[[], torch.Tensor]] = None) -> tuple[Plan, tuple]:
    """The source rank's plan and the events its followers cannot write themselves (`extras`), on every rank, once
    every rank is known to be at step `step` of generation call `call`. A source rank that failed (`error`) raises
    its error there and a RuntimeError naming it on the others. `width`: tokens a row may keep in one step.
    `started`: this rank's share of the header, from `header_started`."""
    place, places = call << 32 | step, HEADER + (2 + width) * rows
    header = None if started else _header(ctx, plan, error, rows, extras, place, width)
    values = _sum_in_step(ctx, header, place, started).tolist()
    _check_places(ctx, values[places:], place)
    if values[STATUS] == FAILED:
        message = ctx.broadcast_object(f"{type(error).__name__}: {error}" if error else None)
        if error is not None:
            raise error
        raise RuntimeError(f"model-parallel source rank failed: {message}")
    stepped, codes, counts, tokens = values[STEPPED], HEADER, HEADER + rows, HEADER + 2 * rows
    results = tuple(RowResult(tuple(values[tokens + row * width:tokens + row * width + values[counts + row]]),
                              values[codes + row]) for row in range(stepped))
    moved = Plan(keep=tuple(range(values[KEPT])))
    if values[MOVES]:  # the batch changes: the second message (which rows stay, the joining prompts, the scored ones)
        moved = ctx.broadcast_object(Plan(keep=plan.keep, joining=plan.joining, score=plan.score)
                                     if ctx.is_source else None)
    if values[EXTRAS]:
        extras = ctx.broadcast_object(extras if ctx.is_source else None)
    next_tokens = tuple(results[row].tokens[-1] for row in moved.keep)
    return replace(moved, tokens=next_tokens, results=results, done=values[STATUS] == DONE), extras


def _header(ctx, plan: Optional[Plan], error: Optional[Exception], rows: int, extras: tuple, place: int,
            width: int) -> torch.Tensor:
    """This rank's share of the step header: the source rank's fields (zeros elsewhere), and its place."""
    places = HEADER + (2 + width) * rows
    header = [0] * (places + ctx.world_size)
    if ctx.is_source:
        status = FAILED if error is not None else DONE if plan.done else RUN
        results = plan.results if plan is not None else ()
        header[:HEADER] = [status, len(plan.keep) if plan else 0, int(bool(plan and plan.moves)), int(bool(extras)),
                           len(results)]
        for row, (tokens, code) in enumerate(results):
            header[HEADER + row] = code
            header[HEADER + rows + row] = len(tokens)
            start = HEADER + 2 * rows + row * width
            header[start:start + len(tokens)] = tokens
    header[places + ctx.rank] = place
    return torch.tensor(header, dtype=torch.long, device=ctx.device)


def _sum_in_step(ctx, header: Optional[torch.Tensor], place: int,
                 started: Optional[Callable[[], torch.Tensor]]) -> torch.Tensor:
    try:
        return started() if started is not None else ctx.sum_in_step(header)
    except TimeoutError:
        await_verdict_on_silent_ranks()
        _disagree(f"rank {ctx.rank} waited {ctx.timeout_s:g} s for the other ranks at {_where(place)}")
    except CollectivesOutOfStep as e:  # shared memory: some rank is in another collective
        _disagree(f"rank {ctx.rank} is at {_where(place)}, but {e}")


def _check_places(ctx, places: list[int], place: int) -> None:
    if any(p != place for p in places):
        elsewhere = ", ".join(f"rank {r} at {_where(p)}" for r, p in enumerate(places) if p != place)
        _disagree(f"rank {ctx.rank} is at {_where(place)}, but {elsewhere}")


def _disagree(what: str) -> None:
    message = (f"the model-parallel ranks are not at the same generation step: {what}. Every rank must make "
               f"the same calls and read their streams to the same point (did some ranks leave a "
               f"stream_generate loop early, or call generate, while others did not?); a rank may also be "
               f"stuck. The process group cannot be used after this")
    announce_failure(message)
    raise RanksDisagree(message)


def _where(place: int) -> str:
    return f"generation call {place >> 32}, step {place & 0xFFFFFFFF}"
