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

With speculative decoding (`EngineSettings.speculative`, speculative.py), each row's step may score its next token
and a few proposed ones (the model's `verify`), and keep several tokens; the scheduler decides which, and the plan
tells every rank.
"""
from __future__ import annotations

import functools
import logging
import os
import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Collection, Iterator, Optional

import torch

from accessory.errors import ConfigError, RanksDisagree
from accessory.generation.draft import DraftProposer
from accessory.generation.model_runner import MIN_COLUMNS, ModelRunner
from accessory.network.components import decode_mask
from accessory.generation.packaged_steps import compiled_step
from accessory.generation.requests import Event, Request
from accessory.generation.plan import Plan
from accessory.generation.scheduler import Follower, Scheduler
from accessory.generation.speculative import NgramProposer, SpeculativeConfig
from accessory.generation.wire import share_plan
from accessory.parallel.watchdog import announce_failure

log = logging.getLogger(__name__)
ROUNDS = 12  # rounds of steps timed to measure speculation's costs (the fastest of each size counts)


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
        self.draft = None
        # speculation_costs(): measured at the first run that speculates (or by warm_up); a test may set them
        self.step_costs: Optional[tuple[float, ...]] = None
        if settings.speculative is not None:
            self._speculate(settings.speculative, draft)

    def _speculate(self, config: SpeculativeConfig, draft) -> None:
        """Check the model can verify proposals, and set up the draft's engine."""
        if any(window is not None for window in self.model.windows):
            raise ConfigError("speculative decoding needs every layer's KV cache full-width; this model's "
                              "sliding-window layers keep only their window (a rejected proposal would overwrite a "
                              "position still in it): run it without speculative_config")
        if (config.method == "draft_model") != (draft is not None):
            raise ConfigError(f"speculative_config method {config.method!r} "
                              f"{'needs a draft model' if draft is None else 'takes no draft model'}")
        if draft is not None:
            self.draft = Engine(draft, self.tokenizer, replace(self.settings, speculative=None))

    def proposer(self, rows: int, columns: int, keep_finished: bool):
        """A run's proposer for speculative decoding (its draft's cache rows, if it has a draft), or None."""
        config = self.settings.speculative
        if config is None:
            return None
        self.speculation_costs()  # before any runner's cache is set up: it times steps on a cache of its own
        if self.draft is not None:
            return DraftProposer(self.draft, rows, columns, keep_finished, self.vocab_size,
                                 config.num_speculative_tokens, adopts=self.drafts_itself)
        return NgramProposer(config)

    def speculation_costs(self) -> tuple[float, ...]:
        """costs[k], k = 0..num_speculative_tokens: what a step that proposes and scores k tokens for one row costs,
        relative to a plain decode step (a verify step of k + 1 tokens, and with a draft, k of its decode steps).
        Timed on the source rank once per engine and shared, so every rank's rows decide alike (collective: every
        rank runs the same steps)."""
        if self.step_costs is None:
            most = self.settings.speculative.num_speculative_tokens
            timed = step_seconds([(self, most + 1)] + ([(self.draft, 1)] if self.draft is not None else []))
            target, draft = timed[0], timed[1][0] if self.draft is not None else 0.0
            costs = tuple((target[k] + k * draft) / target[0] for k in range(most + 1))
            self.step_costs = self.ctx.broadcast_object(costs if self.ctx.is_source else None)
            log.info("speculative decoding: a step proposing 1..%d tokens costs %s plain decode steps (measured)",
                     most, " ".join(f"{cost:.2f}" for cost in self.step_costs[1:]))
        return self.step_costs

    @torch.inference_mode()
    def compile_speculation(self) -> None:
        """Compile the steps speculative decoding runs (verify, and decode at one token a row: the target's and the
        draft's), for one row and for several, at two attention widths (symbolic sizes): feed a throwaway run's rows
        a few tokens each, so that no request waits on their compilation."""
        past = min(MIN_COLUMNS + 8, self.max_seq_len - 8)  # past the narrowest width, if the model reaches it
        for engine in (self, self.draft) if self.draft is not None else (self,):
            verifies = engine in self.verifying_engines()
            for rows in (1, 2):
                for length in (2, past):
                    runner = ModelRunner(engine, rows, length + 8, keep_finished=False)
                    runner.prefill(((1,) * length,) * rows, (None,) * rows)
                    if verifies:
                        runner.feed([(3, 4, 5)] * rows)
                        runner.feed([(6, 7)] * rows)
                    runner.feed([(8,)] * rows)

    @property
    def drafts_itself(self) -> bool:
        """Whether the draft is this model's own checkpoint (`"model": "self"`), which takes its keys and values."""
        return self.draft is not None and self.settings.speculative.model == "self"

    def verifying_engines(self) -> list["Engine"]:
        """The engines whose verify step speculative decoding runs: this one, and a draft model, which catches up
        on several tokens at a time; but not the self-draft, which copies the target's keys and values for them
        (draft.py) and only ever decodes."""
        return [self] if self.draft is None or self.drafts_itself else [self, self.draft]

    def configured(self, **changes) -> "Engine":
        """An engine for the same model with some settings changed; if its steps are the same, it shares this
        one's speculation costs, measured here first if they were not (collective, as the measuring is)."""
        engine = Engine(self.model, self.tokenizer, replace(self.settings, **changes), self.stop_ids, self.draft_model)
        if (engine.settings.speculative, engine.settings.compile) == (self.settings.speculative, self.settings.compile):
            engine.step_costs = self.speculation_costs() if self.settings.speculative is not None else None
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
        that changed any request, on every rank: the latest Event of every request, in order."""
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
            latest = [replace(e, delta="") for e in latest]
            for event in events:
                latest[row_of[event.id]] = event
            yield latest

    def run(self, scheduler: Optional[Scheduler], rows: int, columns: int, keep_finished: bool = True,
            requests: Optional[list[Request]] = None) -> Iterator[list[Event]]:
        """Run steps until the source rank's scheduler is done, on every rank; yield each step's events: on the
        source rank, and, when every rank holds the scheduler's `requests`, on every rank alike. The KV cache holds
        `rows` rows of `columns` positions (rounded up), and with the prefix cache and `keep_finished` (requests
        may join later), rows that keep finished sequences.

        Closing the generator early on every rank at the same point (a `break` in user code that every rank runs)
        ends the run there on every rank, and the group is ready for the next one. If only some ranks stop, every
        rank that is still in a step raises RanksDisagree within the context's timeout_s: the events of such a run
        are yielded after the step's forward pass, so a rank that stops reading has taken part in all of that
        step's collectives, and the others next wait only where they check each other (`wire.share_plan`)."""
        runner = ModelRunner(self, rows, columns, keep_finished)
        followed = requests is not None
        follower = Follower(requests, self.tokenizer) if followed and scheduler is None else None
        self.calls += 1
        logits, step = None, 0
        try:
            while True:
                plan, events = self._next_plan(scheduler, logits, runner, follower, followed, step)
                if events and (plan.done or not followed):
                    yield events
                if plan.done:
                    return
                with self._alone():
                    local, scored = runner.step(plan)
                    logits = self._reduce(scheduler, runner, local)
                if events and followed:
                    yield events
                if scored:
                    scheduler.receive_prompt_logprobs(scored)
                step += 1
        finally:
            if self.model.cache_nbytes > self.settings.keep_cache_bytes:
                self.model.free_caches()

    def _next_plan(self, scheduler, logits, runner: ModelRunner, follower: Optional[Follower], followed: bool,
                   step: int) -> tuple[Plan, list[Event]]:
        """The source rank's plan for the next step, on every rank, with the step's events (on the source rank,
        and on a follower's)."""
        plan, events, error = None, [], None
        if scheduler is not None:
            try:
                plan, events = scheduler.step(logits, runner.proposed)
            except Exception as e:  # tell the other ranks before raising, so they do not wait forever
                error = e
        if self.ctx.world_size == 1:
            if error is not None:
                raise error
            return plan, events
        extras = scheduler.extras if followed and scheduler else ()
        width = 1 + (self.settings.speculative.num_speculative_tokens if self.settings.speculative else 0)
        plan, extras = share_plan(self.ctx, plan, error, runner.rows, extras, self.calls, step, width)
        if follower is not None:
            with self._alone():
                events = follower.events(plan, list(extras))
        return plan, events

    def _reduce(self, scheduler: Optional[Scheduler], runner: ModelRunner, local: Optional[torch.Tensor]):
        """Every rank's slice of the step's logits reduced to what sampling needs, merged (vocab_slices.py)."""
        if local is None:
            return None
        masks = scheduler.masks(runner.proposed, local.shape[1]) if scheduler is not None else None
        return runner.vocab.reduce(local, runner.proposed, masks)

    def vocab_slice(self) -> tuple[range, int]:
        """The token ids whose logits this rank computes (its rows of the output projection, within the ids the
        engine samples), and how many it computes, padded alike on every rank."""
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


@torch.inference_mode()
def step_seconds(engines: list[tuple[Engine, int]]) -> list[list[float]]:
    """For each (engine, most_slots): the seconds of its step scoring 1, 2, .. most_slots tokens at one row (its
    decode step for one, its verify step for more), on a KV cache of its own. Each is the fastest of ROUNDS, the
    steps taken in turn each round: what a step costs without interference, which a median of steps timed one
    size after another was not (costs measured in two processes differed by up to 40%)."""
    steps = [_one_row_steps(engine, most) for engine, most in engines]
    for step in (s for each in steps for s in each):
        step()  # compiles, if that has not happened yet
    seconds = [[float("inf")] * len(each) for each in steps]
    for _ in range(ROUNDS):
        for times, each in zip(seconds, steps):
            for size, step in enumerate(each):
                begin = time.perf_counter()
                step()
                times[size] = min(times[size], time.perf_counter() - begin)
    return seconds


def _one_row_steps(engine: Engine, most_slots: int) -> list:
    """Calls of the engine's step scoring 1, 2, .. most_slots tokens at one row, on a KV cache set up for them."""
    model = engine.model
    columns = min(MIN_COLUMNS, engine.max_seq_len)
    model.setup_caches(2, columns)  # 2 rows, as a runner of one row has
    start = max(0, min(16, columns - most_slots))
    steps = []
    for slots in range(1, most_slots + 1):
        positions = torch.arange(start, start + slots, device=model.device)[None]
        mask = decode_mask(positions, columns)
        if slots == 1:
            first = positions[:, 0].contiguous()
            steps.append(functools.partial(engine.decode_step, torch.ones_like(first), first,
                                           decode_mask(first, columns)))
        else:
            steps.append(functools.partial(engine.verify_step, torch.ones_like(positions), positions, mask))
    return steps
