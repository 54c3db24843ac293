"""The source rank's side of continuous batching: requests wait, join the batch when a row is free, are sampled
step by step, and leave when they stop, run out of tokens, or are cancelled.

Requests may arrive from other threads (`add`, `cancel`); `step` runs on the thread that drives the engine. Only the
source rank samples and decides; the other ranks receive each step's `Plan` (each row's token and whether it ended,
and, when the batch changes, which rows stay and which prompts join), never text. A `Follower` on another rank turns
those plans into the very events the scheduler emitted, with the same detokenization (`Request.push`, `finish`), so
every rank of `Engine.stream` yields the same stream.

A pipeline keeps several micro-batches in flight (engine.py): each is a lane of rows with a scheduler of its own,
and the lanes' schedulers share one `Intake`, where requests arrive and wait for a row in any lane.
"""
from __future__ import annotations

import logging
import queue
import time
from collections import deque
from typing import Collection, Optional, Sequence

import torch

from accessory.generation.constraints import ConstraintError
from accessory.generation.plan import Joining, Plan, RowResult
from accessory.generation.requests import FINISH_CODES, FINISH_REASONS, Event, Request, TokenLogprob
from accessory.generation.sampling import NAN_LOGITS, Candidates, SamplingError, sample
from accessory.generation.speculative import accepted_count
from accessory.generation.vocab_slices import Merged, PositionLogprobs, RowRule

log = logging.getLogger(__name__)


class Intake:
    """Where requests arrive (from any thread) and wait for a row, for the schedulers of one run's lanes."""

    def __init__(self):
        self.inbox: queue.Queue = queue.Queue()  # ("add", request), ("cancel", id) or ("close", None)
        self.waiting: deque[Request] = deque()
        self.closed = False
        self.lanes: list[Scheduler] = []

    def queued(self) -> int:
        """Requests not yet in a batch."""
        return self.inbox.qsize() + len(self.waiting)

    def in_batch(self) -> list[Request]:
        """The requests in every lane's rows (a copy: other threads read it)."""
        return [request for lane in list(self.lanes) for request in list(lane.active)]

    def idle(self) -> bool:
        return not self.waiting and not any(lane.active for lane in self.lanes)


class Scheduler:
    def __init__(self, tokenizer, stop_ids: Collection[int], rows: int, vocab_size: int, device: torch.device,
                 idle_wait_s: float = 0.0, intake: Optional[Intake] = None):
        """`rows`: how many requests decode together. `idle_wait_s`: with nothing to do and not closed, how long
        `step` waits for a request before returning an empty plan (a heartbeat for the other ranks). `intake`:
        another lane's, to share its requests (`lanes`)."""
        self.tokenizer, self.rows, self.vocab_size, self.device = tokenizer, rows, vocab_size, device
        self.stop_ids, self.idle_wait_s = set(stop_ids), idle_wait_s
        self.intake = intake or Intake()
        self.intake.lanes.append(self)
        self.active: list[Request] = []  # in batch-row order
        self.scoring: list[Request] = []  # requests whose prompt logits the step being run computes
        self.extras: tuple[Event, ...] = ()  # the last step's events that a Follower cannot write from its plan
        self.grammar_errors: dict[tuple, Exception] = {}  # (request id, slot) -> why no mask could be made there

    def lanes(self, sizes: Sequence[int]) -> list["Scheduler"]:
        """This scheduler (first) and len(sizes) - 1 more sharing its requests, with sizes[i] rows each: the lanes
        of a pipeline's micro-batches. Called before the first step."""
        self.rows = sizes[0]
        return [self] + [Scheduler(self.tokenizer, self.stop_ids, rows, self.vocab_size, self.device,
                                   self.idle_wait_s, self.intake) for rows in sizes[1:]]

    # ---- from any thread ------------------------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        self.intake.inbox.put(("add", request))

    def cancel(self, request_id) -> None:
        self.intake.inbox.put(("cancel", request_id))

    def close(self) -> None:
        """No more requests: `step` says done once the ones already added have finished."""
        self.intake.inbox.put(("close", None))

    # ---- the driving thread -----------------------------------------------------------------------------------------

    def step(self, logits: Optional[Merged],
             proposals: Sequence[tuple[int, ...]] = ()) -> tuple[Plan, list[Event]]:
        """Sample the last step's merged logits (one row per active request, L positions: the row's next token's,
        and with speculative decoding each of its `proposals`' after it), then plan the next step."""
        events: list[Event] = []
        stepped = list(self.active)  # the rows of `logits`
        for request in stepped:
            request.pushed = []
        if logits is not None:
            self._sample(logits, proposals, events)
        intake = self.intake
        self._read_inbox(events, wait=intake.idle() and not intake.closed)
        results = tuple(RowResult(tuple(r.pushed), FINISH_CODES[r.finish_reason]) for r in stepped)
        rows = {r.id for r in stepped}
        self.extras = tuple(e for e in events if e.id not in rows or e.error is not None or e.logprobs
                            or e.prompt_logprobs is not None)
        survivors = [row for row, request in enumerate(self.active) if request.finish_reason is None]
        keep = _fill_holes(survivors)
        self.active = [self.active[row] for row in keep]
        admitted, share = [], self._share()
        while intake.waiting and len(keep) + len(admitted) < share:
            request = intake.waiting.popleft()
            try:
                self._start(request)
                admitted.append(request)
            except Exception as error:  # this request ends; the others go on
                self._fail(request, error, events)
        self.active += admitted
        done = intake.closed and intake.idle()
        self.scoring = [r for r in admitted if r.params.prompt_logprobs is not None]
        plan = Plan(keep=tuple(keep), tokens=tuple(r.generated[-1] for r in self.active[:len(keep)]),
                    joining=_joining(admitted), score=tuple(tuple(r.tokens) for r in self.scoring),
                    results=results, done=done)
        return plan, events

    def _share(self) -> int:
        """The rows this lane may fill: its own, and with other lanes, its even share of the requests in rows or
        waiting (rounded up), so that every micro-batch has work."""
        lanes = self.intake.lanes
        if len(lanes) == 1:
            return self.rows
        busy = sum(len(lane.active) for lane in lanes) + len(self.intake.waiting)
        return min(self.rows, -(-busy // len(lanes)))

    def masks(self, proposals: Sequence[tuple[int, ...]], slots: int) -> Optional[torch.Tensor]:
        """The grammar bitmasks (constrained rows, slots, words) int32 of the step just run, for every rank to apply
        to its slice: a row's next token's, and after each proposal the mask that follows it, had it been accepted
        (positions it cannot reach allow everything). None when no row is constrained. A mask the grammar engine
        cannot make fails its row when that position is sampled."""
        self.grammar_errors = {}
        rows = [(row, r) for row, r in enumerate(self.active) if r.matcher is not None]
        if not rows:
            return None
        masks = torch.full((len(rows), slots, -(-self.vocab_size // 32)), -1, dtype=torch.int32)
        for i, (row, request) in enumerate(rows):
            matcher, proposed = request.matcher, proposals[row] if row < len(proposals) else ()
            for slot in range(min(slots, len(proposed) + 1)):
                try:
                    masks[i, slot] = matcher.allowed()
                    if slot == len(proposed) or not _allows(masks[i, slot], proposed[slot]):
                        break
                    matcher = matcher.copy() if slot == 0 else matcher
                    matcher.consume(proposed[slot])
                except ConstraintError as error:
                    self.grammar_errors[request.id, slot] = error
                    break
        return masks

    def receive_prompt_logprobs(self, scored: list[PositionLogprobs]) -> None:
        """The log-probabilities of the prompts the last plan scored, in its order; they go out with each request's
        next event."""
        for request, scores in zip(self.scoring, scored):
            request.prompt_logprobs = prompt_logprobs(scores, request.tokens, request.params.prompt_logprobs)

    def _read_inbox(self, events: list, wait: bool) -> None:
        intake = self.intake
        deadline = time.monotonic() + (self.idle_wait_s if wait else 0.0)
        while True:
            try:
                timeout = deadline - time.monotonic()
                kind, value = (intake.inbox.get(timeout=timeout) if timeout > 0 else intake.inbox.get_nowait())
            except queue.Empty:
                return
            if kind == "add":
                intake.waiting.append(value)
            elif kind == "cancel":
                self._cancel(value, events)
            else:
                intake.closed = True
            deadline = 0.0 if intake.waiting else deadline  # once there is work, do not wait for more

    def _cancel(self, request_id, events: list) -> None:
        """End the request in any lane's rows (its lane's next step reports it) or waiting."""
        for request in self.intake.in_batch():
            if request.id == request_id and request.finish_reason is None:
                request.finish("cancelled", events)
        waiting = self.intake.waiting
        for request in [r for r in waiting if r.id == request_id]:
            waiting.remove(request)
            request.start_text(self.tokenizer)
            request.finish("cancelled", events)

    def _start(self, request: Request) -> None:
        request.admitted_at = time.monotonic()
        request.start_text(self.tokenizer)
        request.generator = torch.Generator(device=self.device).manual_seed(request.seed)

    def _sample(self, logits: Merged, proposals: Sequence[tuple[int, ...]], events: list) -> None:
        """Each row's token, as plain decoding samples it; with proposals, the row's next slot is sampled the same
        way while each sample equals the proposal it was scored after (speculative.py: the output is the same)."""
        tokens = logits.ids[..., 0].tolist()  # plain greedy rows' tokens, all at once
        broken = logits.values[..., 0].isnan().tolist()
        for row, request in enumerate(self.active):
            proposed = proposals[row] if proposals else ()
            try:
                for slot in range(len(proposed) + 1):
                    if request.finish_reason is not None:
                        break  # cancelled during the step, or ended by the last token
                    if (request.id, slot) in self.grammar_errors:
                        raise self.grammar_errors[request.id, slot]
                    candidates = None if request.plain_greedy and request.params.logprobs is None else \
                        logits.at(row, slot)
                    token = self._choose(request, candidates, tokens[row][slot], broken[row][slot])
                    self._advance(request, token, candidates, events)
                    if slot == len(proposed) or token != proposed[slot]:
                        break
                request.proposed_tokens += len(proposed)
                request.accepted_tokens += accepted_count(proposed, request.pushed)
            except Exception as error:  # SamplingError, a constraint that failed, a stop string that raised: this
                self._fail(request, error, events)  # request ends; the batch, the others and the server go on

    def _advance(self, request: Request, token: int, candidates: Optional[Candidates], events: list) -> None:
        if token in self.stop_ids:
            request.finish("stop", events)
            return
        request.push(token)
        if request.params.logprobs is not None:
            request.logprobs.append(token_logprob(candidates, token, request.params.logprobs))
        if request.matcher is not None:
            request.matcher.consume(token)
        if request.text.stopped or (request.matcher is not None and request.matcher.finished):
            request.finish("stop", events)
        elif len(request.generated) >= request.params.max_gen_len:
            request.finish("length", events)
        else:
            request.emit(events)

    @staticmethod
    def _choose(request: Request, candidates: Optional[Candidates], greedy_token: int, broken: bool) -> int:
        """The request's token: a plain greedy row's is `greedy_token` (raising if its logits were `broken`); the
        others are sampled from their candidates (bias, penalties and mask applied) with their own generator."""
        if request.plain_greedy:
            if broken:
                raise SamplingError(NAN_LOGITS)
            return greedy_token
        return sample(candidates, request.params, request.generator)

    def _fail(self, request: Request, error: Exception, events: list) -> None:
        message = f"{type(error).__name__}: {error}"
        log.error("request %s failed after %d token(s): %s", request.id, len(request.generated), message)
        request.fail(message, events)


class Follower:
    """Another rank's copy of the requests that the source rank's scheduler runs (`Engine.stream`: every rank
    holds the same requests). From each step's plan, each row's token and how it ended, it writes the same events
    with the same code, so every rank yields the same stream and no text is sent. What the source rank alone can
    know (an error's message, log-probabilities, a request that never got a row) comes with the plan as `extras`:
    the source rank's events for those requests."""

    def __init__(self, requests: Sequence[Request], tokenizer):
        self.requests, self.tokenizer = {r.id: r for r in requests}, tokenizer
        self.active: list[Request] = []  # in batch-row order, as on the source rank

    def events(self, plan: Plan, extras: Sequence[Event]) -> list[Event]:
        events: list[Event] = []
        for request, (tokens, code) in zip(self.active, plan.results):
            for token in tokens:
                request.push(token)
            if code == FINISH_CODES["error"]:
                request.finish_reason = "error"
            elif code:
                request.finish(FINISH_REASONS[code], events)
            else:
                request.emit(events)
        self.active = [self.active[row] for row in plan.keep]
        for request_id in plan.joining.ids:
            self.requests[request_id].start_text(self.tokenizer)
            self.active.append(self.requests[request_id])
        # the source rank's own events where they hold more than the tokens tell
        extras = {e.id: e for e in extras}
        return [extras.pop(e.id, e) for e in events] + list(extras.values())


def prompt_logprobs(scores: PositionLogprobs, tokens: list[int], top: int) -> tuple[TokenLogprob, ...]:
    """Each prompt token's log-probability given those before it, with the `top` most likely there (the first
    token's is None: it has no context), from `scores` at the prompt's positions but the last."""
    chosen, ids, values = (scores.chosen.tolist(), scores.top_ids[:, :top].tolist(),
                           scores.top_logprobs[:, :top].tolist())
    after = [TokenLogprob(token, chosen[i], tuple(zip(ids[i], values[i]))) for i, token in enumerate(tokens[1:])]
    return (TokenLogprob(tokens[0], None), *after)


def token_logprob(candidates: Candidates, token: int, top: int) -> TokenLogprob:
    """`token`'s log-probability under the raw logits (it is one of the candidates), and the `top` most likely
    tokens'."""
    value = candidates.raw[(candidates.ids == token).nonzero()[0, 0]]
    best = tuple(zip(candidates.top_ids[:top].tolist(), (candidates.top_values[:top] - candidates.raw_lse).tolist()))
    return TokenLogprob(token, float(value - candidates.raw_lse), best)


def _joining(admitted: list[Request]) -> Joining:
    images = tuple(r.image for r in admitted)
    adapters = tuple(r.adapter for r in admitted)
    return Joining(prompts=tuple(tuple(r.tokens) for r in admitted), ids=tuple(r.id for r in admitted),
                   images=images if any(i is not None for i in images) else (),
                   adapters=adapters if any(adapters) else (),
                   rules=tuple(RowRule(r.params, r.matcher is not None) for r in admitted))


def _allows(bits: torch.Tensor, token: int) -> bool:
    return bool((int(bits[token // 32]) >> token % 32) & 1)


def _fill_holes(survivors: list[int]) -> list[int]:
    """New row order for the surviving rows: those already in the first len(survivors) rows stay put, and the
    rest fill the holes, so only the rows that must move are copied."""
    n = len(survivors)
    staying = [row for row in survivors if row < n]
    movers = iter(row for row in survivors if row >= n)
    stays = set(staying)
    return [row if row in stays else next(movers) for row in range(n)]
