"""The engine: continuous batching in lockstep over a model-parallel group, around a static decode step.

Every rank runs the same steps and the source rank decides them. Each step of `Engine.run`:
1. what runs next (scheduler.py): the source rank's `Scheduler` samples the last step's logits, detokenizes, emits
   events, and writes the next `Plan`;
2. what the ranks tell each other (wire.py): the plan reaches every rank in a small fixed-size header (a second
   message only when the batch changes), and every rank checks that all are at the same step;
3. what runs on each rank (model_runner.py): every rank's `ModelRunner` runs the plan on its KV cache rows;
4. what sampling needs (vocab_slices.py): each rank reduces its slice of the vocabulary's logits to a few
   candidates, and every rank merges every rank's.
In `stream`, every rank holds the requests, and the other ranks' `Follower`s write the same events from the tokens,
so every rank yields the same stream.

With speculative decoding (`EngineSettings.speculative`: speculation.py, speculative.py), each row's step may score
its next token and a few proposed ones (the model's `verify`), and keep several tokens; the scheduler decides which,
and the plan tells every rank.
"""
from __future__ import annotations

import os
import shutil
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Collection, Iterator, Optional

from accessory.errors import ConfigError, RanksDisagree
from accessory.generation.model_runner import ModelRunner, Stepped
from accessory.generation.packaged_steps import compiled_step
from accessory.generation.plan import Plan
from accessory.generation.requests import Event, Request
from accessory.generation.scheduler import Follower, Scheduler
from accessory.generation.speculation import Speculation
from accessory.generation.speculative import SpeculativeConfig
from accessory.generation.vocab_slices import Merged, PositionLogprobs
from accessory.generation.wire import header_started, share_plan
from accessory.network.kv_caches import KVCaches
from accessory.parallel.layers import make_shard
from accessory.parallel.watchdog import announce_failure


@dataclass(frozen=True)
class EngineSettings:
    """How the engine runs a model, chosen when loading it (MetaModel.from_pretrained, the CLI's flags).

    `max_batch_size`: rows decoded together; more requests wait for a free row. `compile`: compile the decode
    step with torch.compile (CUDA graphs on CUDA): tens of seconds at the first call, faster steps after.
    `keep_cache_bytes`: after a run, a KV cache up to this size stays allocated for the next one.
    `prefix_cache`: a prompt that starts with tokens already in the KV cache reuses them instead of recomputing
    them. `prefix_cache_bytes`: finished sequences are kept for that in extra cache rows, as many whole rows as fit
    in this many bytes per rank (at most max_batch_size rows; 0 keeps none, and live rows are still shared).
    `speculative`: speculative decoding's proposer (None: none)."""
    max_batch_size: int = 32
    compile: bool = False
    keep_cache_bytes: int = 256 << 20
    prefix_cache: bool = True
    prefix_cache_bytes: int = 256 << 20
    speculative: Optional[SpeculativeConfig] = None

    def __post_init__(self):
        if not isinstance(self.max_batch_size, int) or self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be an integer >= 1, got {self.max_batch_size!r}")
        if not isinstance(self.prefix_cache_bytes, int) or self.prefix_cache_bytes < 0:
            raise ValueError(f"prefix_cache_bytes must be an integer >= 0, got {self.prefix_cache_bytes!r}")


@dataclass
class EngineStats:
    """Since the engine was built: prompt tokens computed by prefill, and reused from the KV cache instead; tokens
    proposed by speculative decoding, and of those, accepted."""
    prefilled_tokens: int = 0
    reused_tokens: int = 0
    proposed_tokens: int = 0
    accepted_tokens: int = 0


class Engine:
    """One per loaded model: MetaModel, the server, batch jobs, the demos and the tests all drive this object."""

    def __init__(self, model, tokenizer, settings: EngineSettings = EngineSettings(),
                 stop_ids: Collection[int] = (), draft=None):
        """`draft`: speculative decoding's draft network (settings.speculative's method "draft_model")."""
        self.model, self.tokenizer, self.settings, self.draft_model = model, tokenizer, settings, draft
        self.ctx = model.ctx
        self.stop_ids = set(stop_ids)  # EOS and the chat template's end-of-turn token: they end any request
        if settings.compile and model.device.type == "cpu" and not shutil.which(os.environ.get("CXX", "c++")):
            raise ConfigError("compile=True on the CPU needs a C++ compiler (torch's inductor writes C++): install "
                              "one (g++), or run without --compile")
        self.decode_step = compiled_step(model, "decode") if settings.compile else model.decode
        # several tokens per row (speculative decoding; a draft catching up), compiled lazily: at its first call
        self.verify_step = compiled_step(model, "verify") if settings.compile else model.verify
        # The ids it samples from: the model's rows the tokenizer can write. LLaVA pads its table past the
        # tokenizer's (32064 rows, 32002 tokens), and an id the tokenizer cannot decode would end the request.
        self.vocab_size = min(model.args.vocab_size, tokenizer.n_words)
        self.stats = EngineStats()  # the same on every rank
        self.calls = 0  # runs started: the same count on every rank that runs the same code
        self.kept: list[KVCaches] = []  # the last run's KV caches (a lane's each), if they fit keep_cache_bytes
        self.speculation = Speculation(self, settings.speculative, draft) if settings.speculative else None

    def configured(self, **changes) -> "Engine":
        """An engine for the same model with some settings changed; if its steps are the same, it shares this
        one's speculation costs, measured here first if they were not (collective, as the measuring is)."""
        engine = Engine(self.model, self.tokenizer, replace(self.settings, **changes), self.stop_ids, self.draft_model)
        same_steps = (engine.settings.speculative, engine.settings.compile) == (self.settings.speculative,
                                                                                self.settings.compile)
        if self.speculation is not None and same_steps:
            engine.speculation.step_costs = self.speculation.costs()
        return engine

    @property
    def max_seq_len(self) -> int:
        return self.model.args.max_seq_len

    def scheduler(self, rows: int, idle_wait_s: float = 0.0) -> Optional[Scheduler]:
        """A scheduler for `rows` rows on the source rank; None on the others."""
        if not self.ctx.is_source:
            return None
        return Scheduler(self.tokenizer, self.stop_ids, rows, self.vocab_size, self.model.device,
                         idle_wait_s)

    def stream(self, requests: list[Request]) -> Iterator[list[Event]]:
        """Complete `requests` (every rank passes the same ones), at most max_batch_size at a time. After each step
        that changed any request, on every rank: the latest Event of every request, in order (what a step adds, its
        delta and log-probabilities, only in that step's)."""
        rows = min(len(requests), self.settings.max_batch_size)
        columns = max(len(r.tokens) + r.params.max_gen_len for r in requests)
        scheduler = self.scheduler(rows)
        latest = [Event(r.id) for r in requests]
        if scheduler is not None:
            for request in requests:
                scheduler.add(request)
            scheduler.close()
        row_of = {r.id: i for i, r in enumerate(requests)}
        for events in self.run(scheduler, rows, columns, keep_finished=len(requests) > rows, requests=requests):
            latest = [replace(e, delta="", logprobs=(), prompt_logprobs=None) for e in latest]
            for event in events:
                latest[row_of[event.id]] = event
            yield latest

    def run(self, scheduler: Optional[Scheduler], rows: int, columns: int, keep_finished: bool = True,
            requests: Optional[list[Request]] = None) -> Iterator[list[Event]]:
        """Run steps until the source rank's scheduler is done, on every rank; yield each step's events: on the
        source rank, and, when every rank holds the scheduler's `requests`, on every rank alike. The KV cache holds
        `rows` rows of `columns` positions (rounded up), and with the prefix cache and `keep_finished` (requests
        may join later), rows that keep finished sequences.

        Under a pipeline of several stages, the rows are split into one lane (micro-batch) per stage when there are
        as many (`Lane`), and stage s runs each plan s steps after the first stage: while the last stage finishes
        one lane's step, the first begins the next lane's, with the tokens the source rank has just sampled. Where
        the step header goes point to point (across machines), a later stage sends its share ahead and runs the plan
        it already holds while the source rank plans (`wire.header_started`); where reducing that step only sends
        this rank's part to the source rank (no row samples or has a grammar: `Lane.sends_only`), it does so at once,
        before it takes the plan, so the candidates reach the source rank sooner.

        Closing the generator early on every rank at the same point (a `break` in user code that every rank runs)
        ends the run there on every rank, and the group is ready for the next one (a pipeline's later stages first
        run the plans they had yet to run, to take what the stages before them sent). If only some ranks stop,
        every rank that is still in a step raises RanksDisagree within the context's timeout_s: the events of such
        a run are yielded after the step's forward pass, so a rank that stops reading has taken part in all of that
        step's collectives, and the others next wait only where they check each other (`wire.share_plan`)."""
        lanes = self._lanes(scheduler, rows, columns, keep_finished, requests)
        followed, stage = requests is not None, self.model.stage
        behind = stage.index if len(lanes) > 1 else 0  # how many steps after the first stage this rank runs a plan
        last = stage.count - 1 if len(lanes) > 1 else 0  # ... and the last stage's, which the ranks then reduce
        unrun: deque[tuple[int, Plan]] = deque()  # the plans this rank has yet to run, with their steps
        self.calls += 1
        step = 0
        try:
            while True:
                lane = lanes[step % len(lanes)]
                reduced = lanes[(step - last) % len(lanes)] if step >= last else None
                started = (header_started(self.ctx, lane.runner.rows, self.calls, step)
                           if behind and step >= behind else None)
                ahead = False  # whether this rank reduced before the plan
                if started is not None:  # this stage's next plan is known: run it while the source rank plans
                    with self._alone():
                        self._run_next(lanes, unrun)
                        # ... and send the source rank its candidates at once, if that is all the reduction asks
                        ahead = reduced is not None and reduced.sends_only()
                        if ahead:
                            reduced.reduce()
                plan, events = self._next_plan(lane, followed, step, started)
                if events and (plan.done or not followed):
                    yield events
                if plan.done:
                    stage.settle()
                    return
                unrun.append((step, plan))
                with self._alone():
                    if started is None and step >= behind:
                        self._run_next(lanes, unrun)
                    scored = reduced.reduce() if reduced is not None and not ahead else []
                if events and followed:
                    yield events
                if scored:
                    reduced.scheduler.receive_prompt_logprobs(scored)
                step += 1
        except GeneratorExit:  # every rank stopped reading here: run what the stages before this one sent
            with self._alone():
                while unrun:
                    self._run_next(lanes, unrun)
                stage.settle()
            raise
        finally:
            self.kept = [lane.runner.caches for lane in lanes]
            if sum(caches.nbytes(self.model) for caches in self.kept) > self.settings.keep_cache_bytes:
                self.kept = []

    @staticmethod
    def _run_next(lanes: list["Lane"], unrun: deque) -> None:
        ran, plan = unrun.popleft()
        lanes[ran % len(lanes)].run(plan)

    def _lanes(self, scheduler: Optional[Scheduler], rows: int, columns: int, keep_finished: bool,
               requests: Optional[list[Request]]) -> list["Lane"]:
        """One lane per pipeline stage, if the rows go round (else one), each with its share of the rows."""
        count = self.model.stage.count if rows >= self.model.stage.count else 1
        sizes = [rows // count + (i < rows % count) for i in range(count)]
        schedulers = scheduler.lanes(sizes) if scheduler is not None else [None] * count
        followers = [Follower(requests, self.tokenizer) if requests is not None and scheduler is None else None
                     for _ in sizes]
        return [Lane(ModelRunner(self, size, columns, keep_finished, count), lane_scheduler, follower)
                for size, lane_scheduler, follower in zip(sizes, schedulers, followers)]

    def _next_plan(self, lane: "Lane", followed: bool, step: int, started=None) -> tuple[Plan, list[Event]]:
        """The source rank's plan for `lane`'s next step (the run's `step`), on every rank, with the step's events
        (on the source rank, and on a follower's); `started`: this rank's share of the header, sent ahead."""
        scheduler, runner = lane.scheduler, lane.runner
        plan, events, error = None, [], None
        if scheduler is not None:
            try:
                plan, events = scheduler.step(lane.logits, runner.proposed)
            except Exception as e:  # tell the other ranks before raising, so they do not wait forever
                error = e
        lane.logits = None
        if self.ctx.world_size == 1:
            if error is not None:
                raise error
            return plan, events
        extras = scheduler.extras if followed and scheduler else ()
        width = 1 + (self.settings.speculative.num_speculative_tokens if self.settings.speculative else 0)
        plan, extras = share_plan(self.ctx, plan, error, runner.rows, extras, self.calls, step, width, started)
        if lane.follower is not None:
            with self._alone():
                events = lane.follower.events(plan, list(extras))
        return plan, events

    def caches(self, rows: int, columns: int) -> KVCaches:
        """KV caches of `rows` rows of `columns` positions for a run: one of the last run's, if one is that size
        (its contents are the new run's to overwrite); if none is, the last run's are released first, so that old
        and new never coexist."""
        kept = next((caches for caches in self.kept if caches.shape == (rows, columns)), None)
        self.kept = [caches for caches in self.kept if caches is not kept] if kept is not None else []
        return kept if kept is not None else KVCaches.allocate(self.model, rows, columns)

    def vocab_slice(self) -> tuple[range, int]:
        """The token ids whose logits this rank computes (its rows of the output projection, within the ids the
        engine samples), and how many it computes, padded alike on every rank."""
        if not self.model.stage.last:  # the head is on the last pipeline stage: no ids here, padded as there
            return range(0), make_shard(0, self.model.args.vocab_size, self.model.stage.tensor.world_size, 0).local_size
        shard = self.model.output.weight_shard
        return range(shard.start, max(shard.start, min(shard.stop, self.vocab_size))), shard.local_size

    @contextmanager
    def _alone(self):
        """Where a failure may be this rank's alone (a step, a follower's detokenizing): the others would wait for
        this rank in their next collective, so their watchdogs are told to end them, naming this failure."""
        try:
            yield
        except Exception as error:
            if self.ctx.world_size > 1 and not isinstance(error, RanksDisagree):
                announce_failure(f"{type(error).__name__}: {error} (generation call {self.calls})")
            raise


@dataclass
class Lane:
    """One micro-batch of a run's rows: its KV caches and what each row holds (`runner`), the source rank's
    scheduler of them (None elsewhere) or the follower that writes their events, the step this rank has run and
    the ranks have yet to reduce, and the reduced logits that the scheduler's next step samples."""
    runner: ModelRunner
    scheduler: Optional[Scheduler]
    follower: Optional[Follower]
    stepped: Optional[Stepped] = None
    logits: Optional[Merged] = None

    def run(self, plan: Plan) -> None:
        self.stepped = self.runner.step(plan)

    def sends_only(self) -> bool:
        """Whether reducing the step run only sends this rank's part to the source rank (nothing comes back)."""
        return self.stepped is None or (not self.stepped.scores and self.runner.vocab.sends_only)

    def reduce(self) -> list[PositionLogprobs]:
        """Collective: reduce the step run (the logits for the scheduler's next step); the log-probabilities of
        the prompts it scored, on the source rank."""
        self.logits, scored = self.runner.reduce(self.stepped, self.scheduler)
        self.stepped = None
        return scored
