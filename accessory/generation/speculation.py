"""Speculative decoding around one engine (speculative.py says what it is; draft.py how a draft model proposes):
`Speculation` checks that the model can verify proposals, holds the draft's engine, measures once what a step
proposing k tokens costs (every rank's rows then decide alike how many to propose), makes each run's proposer, and
compiles the steps speculation runs ahead of the first request.
"""
from __future__ import annotations

import functools
import logging
import time
from dataclasses import replace

import torch

from accessory.errors import ConfigError
from accessory.generation.draft import DraftProposer
from accessory.generation.model_runner import MIN_COLUMNS, ModelRunner
from accessory.generation.speculative import NgramProposer, SpeculativeConfig
from accessory.network.components import decode_mask
from accessory.network.kv_caches import KVCaches

log = logging.getLogger(__name__)
ROUNDS = 12  # rounds of steps timed to measure the costs (the fastest of each size counts)


class Speculation:
    """Speculative decoding for `engine`, by `config`, with `draft_model` (the draft network, for method
    "draft_model"; else None)."""

    def __init__(self, engine, config: SpeculativeConfig, draft_model):
        if any(window is not None for window in engine.model.windows):
            raise ConfigError("speculative decoding needs every layer's KV cache full-width; this model's "
                              "sliding-window layers keep only their window (a rejected proposal would overwrite a "
                              "position still in it): run it without speculative_config")
        config.check_window(engine.max_seq_len)  # before costs() allocates caches for a step of that many tokens
        if (config.method == "draft_model") != (draft_model is not None):
            raise ConfigError(f"speculative_config method {config.method!r} "
                              f"{'needs a draft model' if draft_model is None else 'takes no draft model'}")
        self.engine, self.config = engine, config
        self.draft = None  # the draft model's engine: the target's settings, without speculation
        if draft_model is not None:
            self.draft = type(engine)(draft_model, engine.tokenizer, replace(engine.settings, speculative=None))
        self.step_costs: tuple[float, ...] | None = None  # measured at the first run (or warm-up); tests may set them

    def proposer(self, rows: int, columns: int, keep_finished: bool):
        """A run's proposer (with a draft, its cache rows as the target runner's `rows` and `columns`)."""
        self.costs()
        if self.draft is not None:
            return DraftProposer(self.draft, rows, columns, keep_finished, self.engine.vocab_size,
                                 self.config.num_speculative_tokens, adopts=self.drafts_itself)
        return NgramProposer(self.config)

    def costs(self) -> tuple[float, ...]:
        """costs[k], k = 0..num_speculative_tokens: what a step that proposes and scores k tokens for one row costs,
        relative to a plain decode step (a verify step of k + 1 tokens, and with a draft, k of its decode steps).
        Timed on the source rank once and shared, so every rank's rows decide alike (collective: every rank runs
        the same steps)."""
        if self.step_costs is None:
            most, ctx = self.config.num_speculative_tokens, self.engine.ctx
            timed = step_seconds([(self.engine, most + 1)] + ([(self.draft, 1)] if self.draft is not None else []))
            target, draft = timed[0], timed[1][0] if self.draft is not None else 0.0
            costs = tuple((target[k] + k * draft) / target[0] for k in range(most + 1))
            self.step_costs = ctx.broadcast_object(costs if ctx.is_source else None)
            log.info("speculative decoding: a step proposing 1..%d tokens costs %s plain decode steps (measured)",
                     most, " ".join(f"{cost:.2f}" for cost in self.step_costs[1:]))
        return self.step_costs

    @torch.inference_mode()
    def compile(self) -> None:
        """Compile the steps speculative decoding runs (verify, and decode at one token a row: the target's and the
        draft's), for one row and for several, at two attention widths (symbolic sizes): feed a throwaway run's rows
        a few tokens each, so that no request waits on their compilation."""
        target = self.engine
        past = min(MIN_COLUMNS + 8, target.max_seq_len - 8)  # past the narrowest width, if the model reaches it
        for engine in (target, self.draft) if self.draft is not None else (target,):
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
        """Whether the draft is the target's own checkpoint (`"model": "self"`), which takes its keys and values."""
        return self.draft is not None and self.config.model == "self"

    def verifying_engines(self) -> list:
        """The engines whose verify step speculative decoding runs: the target, and a draft model, which catches up
        on several tokens at a time; but not the self-draft, which copies the target's keys and values for them
        (draft.py) and only ever decodes."""
        return [self.engine] if self.draft is None or self.drafts_itself else [self.engine, self.draft]


@torch.inference_mode()
def step_seconds(engines: list[tuple]) -> list[list[float]]:
    """For each (engine, most_slots): the seconds of its step scoring 1, 2, .. most_slots tokens at one row (its
    decode step for one, its verify step for more), on KV caches of their own. Each is the fastest of ROUNDS, the
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


def _one_row_steps(engine, most_slots: int) -> list:
    """Calls of the engine's step scoring 1, 2, .. most_slots tokens at one row, on KV caches of their own."""
    model = engine.model
    columns = min(MIN_COLUMNS, engine.max_seq_len)
    caches = KVCaches.allocate(model, 2, columns)  # 2 rows, as a runner of one row has
    start = max(0, min(16, columns - most_slots))
    steps = []
    for slots in range(1, most_slots + 1):
        positions = torch.arange(start, start + slots, device=model.device)[None]
        mask = decode_mask(positions, columns)
        if slots == 1:
            first = positions[:, 0].contiguous()
            steps.append(functools.partial(engine.decode_step, torch.ones_like(first), first,
                                           decode_mask(first, columns), caches))
        else:
            steps.append(functools.partial(engine.verify_step, torch.ones_like(positions), positions, mask, caches))
    return steps
