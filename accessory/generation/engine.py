"""The engine: continuous batching in lockstep over a model-parallel group, around a static decode step.

Every rank runs the same steps and the source rank decides them: its `Scheduler` samples the last step's logits,
detokenizes, emits events, and writes the next `Plan`. Per step the ranks add up one small integer tensor of fixed
size: the source rank's header (status, kept rows, whether rows move, each row's token and whether it ended) and
every rank's place (which generation call, which step), so every rank checks that all are at the same step. Only
when the batch changes (a row leaves from the middle, prompts join) does a second message carry which rows stay and
the new prompts' token ids. No text is sent, and nothing sent per step grows with the length of the output. In
`stream`, every rank holds the requests, and the other ranks' `Follower`s write the same events from the tokens, so
every rank yields the same stream. Each step's logits are gathered to the source rank alone.

A row's token at position p lives in KV-cache column p: rows at different positions share one cache, nothing is
padded, and a row that leaves frees its cache row at once (a live row from the end takes its place). A step decodes
the kept rows with `Transformer.decode` (static shapes, no host sync; with `compile`, one compiled graph with symbolic
sizes, and one for a single row) and prefills the joining prompts packed into one sequence. A joining prompt that
starts with tokens some cache row already holds (a live row, or a finished one kept for reuse) copies their keys
and values instead of recomputing them (prefix.py); every rank decides that alike from the plans.
"""
from __future__ import annotations

import logging
import os
import shutil
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Collection, Iterator, Optional

import torch
import torch.fx.experimental._config as fx_config

from accessory.errors import ConfigError, RanksDisagree
from accessory.generation.prefix import RetainedRows, plan_reuse, waves
from accessory.generation.requests import Event, Request
from accessory.generation.scheduler import Follower, Plan, Scheduler
from accessory.parallel.watchdog import announce_failure, await_verdict_on_silent_ranks
from accessory.network.components import Segment, decode_mask
from accessory.network.vision import image_key

log = logging.getLogger(__name__)

RUN, DONE, FAILED = 0, 1, 2  # the status of a step, as sent
# The header's first fields (the source rank's; the others add zeros): then each stepped row's token, each one's
# finish code, and one slot per rank for its place.
STATUS, KEPT, MOVES, EXTRAS, STEPPED, HEADER = range(6)
MIN_COLUMNS = 256  # the smallest KV-cache and attention width: widths are powers of two from here
PREFILL_TOKENS = 4096  # prompt tokens prefilled in one forward pass at most (more run in several)


@dataclass(frozen=True)
class EngineSettings:
    """How the engine runs a model, chosen when loading it (MetaModel.from_pretrained, the CLI's flags).

    `max_batch_size`: rows decoded together; more requests wait for a free row. `compile`: compile the decode
    step with torch.compile (CUDA graphs on CUDA): tens of seconds at the first call, faster steps after.
    `keep_cache_bytes`: after a run, a KV cache up to this size stays allocated for the next one.
    `prefix_cache`: a prompt that starts with tokens already in the KV cache reuses them instead of recomputing
    them. `prefix_cache_bytes`: finished sequences are kept for that in extra cache rows, as many whole rows as fit
    in this many bytes per rank (at most max_batch_size rows; 0 keeps none, and live rows are still shared)."""
    max_batch_size: int = 32
    compile: bool = False
    keep_cache_bytes: int = 256 << 20
    prefix_cache: bool = True
    prefix_cache_bytes: int = 256 << 20

    def __post_init__(self):
        if not isinstance(self.max_batch_size, int) or self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be an integer >= 1, got {self.max_batch_size!r}")
        if not isinstance(self.prefix_cache_bytes, int) or self.prefix_cache_bytes < 0:
            raise ValueError(f"prefix_cache_bytes must be an integer >= 0, got {self.prefix_cache_bytes!r}")


@dataclass
class PrefillStats:
    """Prompt tokens since the engine was built: computed by prefill, and reused from the KV cache instead."""
    prefilled_tokens: int = 0
    reused_tokens: int = 0


class Engine:
    """One per loaded model: MetaModel, the server, batch jobs, the demos and the tests all drive this object."""

    def __init__(self, model, tokenizer, settings: EngineSettings = EngineSettings(),
                 stop_ids: Collection[int] = ()):
        self.model, self.tokenizer, self.settings = model, tokenizer, settings
        self.ctx = model.ctx
        self.stop_ids = set(stop_ids)  # EOS and the chat template's end-of-turn token: they end any request
        if settings.compile and model.device.type == "cpu" and not shutil.which(os.environ.get("CXX", "c++")):
            raise ConfigError("compile=True on the CPU needs a C++ compiler (torch's inductor writes C++): install "
                              "one (g++), or run without --compile")
        self.decode_step = compiled(model.decode, model.device) if settings.compile else model.decode
        # The ids it samples from: the model's rows the tokenizer can write. LLaVA pads its table past the
        # tokenizer's (32064 rows, 32002 tokens), and an id the tokenizer cannot decode would end the request.
        self.vocab_size = min(model.args.vocab_size, tokenizer.n_words)
        self.stats = PrefillStats()  # the same on every rank
        self.calls = 0  # runs started: the same count on every rank that runs the same code

    def configured(self, **changes) -> "Engine":
        """An engine for the same model with some settings changed."""
        return Engine(self.model, self.tokenizer, replace(self.settings, **changes), self.stop_ids)

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
        step's collectives, and the others next wait only where they check each other (`_share`)."""
        batch = Batch(self, rows, _bucket(columns, self.max_seq_len), keep_finished)
        followed = requests is not None
        follower = Follower(requests, self.tokenizer) if followed and scheduler is None else None
        self.calls += 1
        logits, step = None, 0
        try:
            while True:
                plan, events = self._next_plan(scheduler, logits, batch.rows, follower, followed, step)
                if events and (plan.done or not followed):
                    yield events
                if plan.done:
                    return
                with self._alone():
                    logits, scored = batch.step(plan)
                if events and followed:
                    yield events
                if scored:
                    scheduler.receive_prompt_logits(scored)
                step += 1
        finally:
            if self.model.cache_nbytes > self.settings.keep_cache_bytes:
                self.model.free_caches()

    def _next_plan(self, scheduler, logits, rows: int, follower: Optional[Follower], followed: bool,
                   step: int) -> tuple[Plan, list[Event]]:
        """The source rank's plan for the next step, on every rank, with the step's events (on the source rank,
        and on a follower's)."""
        plan, events, error = None, [], None
        if scheduler is not None:
            try:
                plan, events = scheduler.step(logits)
            except Exception as e:  # tell the other ranks before raising, so they do not wait forever
                error = e
        if self.ctx.world_size == 1:
            if error is not None:
                raise error
            return plan, events
        plan, extras = self._share(plan, error, rows, scheduler.extras if followed and scheduler else (), step)
        if follower is not None:
            with self._alone():
                events = follower.events(plan, list(extras))
        return plan, events

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

    def _share(self, plan: Optional[Plan], error: Optional[Exception], rows: int, extras: tuple,
               step: int) -> tuple[Plan, tuple]:
        """The source rank's plan and the events its followers cannot write themselves (`extras`), on every rank."""
        ctx, places = self.ctx, HEADER + 2 * rows
        header = torch.zeros(places + ctx.world_size, dtype=torch.long, device=ctx.device)
        if ctx.is_source:
            status = FAILED if error is not None else DONE if plan.done else RUN
            results = plan.results if plan is not None else ()
            header[:HEADER] = torch.tensor([status, len(plan.keep) if plan else 0, int(bool(plan and plan.moves)),
                                            int(bool(extras)), len(results)])
            if results:
                tokens, codes = zip(*results)
                header[HEADER:HEADER + len(results)] = torch.tensor(tokens)
                header[HEADER + rows:HEADER + rows + len(results)] = torch.tensor(codes)
        place = self.calls << 32 | step
        header[places + ctx.rank] = place
        values = self._sum_in_step(header, place).tolist()
        self._check_places(values[places:], place)
        if values[STATUS] == FAILED:
            message = ctx.broadcast_object(f"{type(error).__name__}: {error}" if error else None)
            if error is not None:
                raise error
            raise RuntimeError(f"model-parallel source rank failed: {message}")
        stepped = values[STEPPED]
        results = tuple(zip(values[HEADER:HEADER + stepped], values[HEADER + rows:HEADER + rows + stepped]))
        keep, admit, score, images, admitted = tuple(range(values[KEPT])), (), (), (), ()
        if values[MOVES]:
            keep, admit, score, images, admitted = ctx.broadcast_object(
                (plan.keep, plan.admit, plan.score, plan.images, plan.admitted) if ctx.is_source else None)
        if values[EXTRAS]:
            extras = ctx.broadcast_object(extras if ctx.is_source else None)
        tokens = tuple(results[row][0] for row in keep)
        return Plan(keep, tokens, admit, values[STATUS] == DONE, score, images, results, admitted), extras

    def _sum_in_step(self, header: torch.Tensor, place: int) -> torch.Tensor:
        try:
            return self.ctx.sum_in_step(header)
        except TimeoutError:
            await_verdict_on_silent_ranks()
            self._disagree(f"rank {self.ctx.rank} waited {self.ctx.timeout_s:g} s for the other ranks at "
                           f"{_where(place)}")

    def _check_places(self, places: list[int], place: int) -> None:
        if any(p != place for p in places):
            elsewhere = ", ".join(f"rank {r} at {_where(p)}" for r, p in enumerate(places) if p != place)
            self._disagree(f"rank {self.ctx.rank} is at {_where(place)}, but {elsewhere}")

    def _disagree(self, what: str) -> None:
        message = (f"the model-parallel ranks are not at the same generation step: {what}. Every rank must make "
                   f"the same calls and read their streams to the same point (did some ranks leave a "
                   f"stream_generate loop early, or call generate, while others did not?); a rank may also be "
                   f"stuck. The process group cannot be used after this")
        announce_failure(message)
        raise RanksDisagree(message)


class Batch:
    """One run's rows on this rank: the KV cache (allocated here) and what each row holds. Rows 0..n-1 are the live
    ones; past the batch's rows, `retained` keeps finished sequences for prompts to reuse."""

    def __init__(self, engine: Engine, rows: int, columns: int, keep_finished: bool = True):
        self.engine, self.model, self.rows, self.columns = engine, engine.model, rows, columns
        self.cached: list[list[int]] = []  # the tokens each live row holds in columns 0..len-1 (fed, not sampled)
        live = max(rows, 2)  # at least 2: torch.compile gives a size of 1 a graph of its own; a cache row is cheap
        self.retained = RetainedRows(live, self._retained_rows(rows, columns) if keep_finished else 0)
        with torch.inference_mode():
            self.model.setup_caches(live + len(self.retained.tokens), columns)

    def _retained_rows(self, rows: int, columns: int) -> int:
        """Finished sequences kept: as many rows as fit in prefix_cache_bytes, at most the batch's rows."""
        settings = self.engine.settings
        if not settings.prefix_cache:
            return 0
        return min(rows, settings.prefix_cache_bytes // self.model.cache_row_nbytes(columns))

    @torch.inference_mode()
    def step(self, plan: Plan) -> tuple[Optional[torch.Tensor], list[torch.Tensor]]:
        """Run `plan`: logits (rows after the step, vocab) on the source rank, None elsewhere or if no rows run;
        and the logits (length, vocab) of each prompt the plan scores, on the source rank (else [])."""
        scored = [self._score(tokens) for tokens in plan.score]
        self._compact(plan.keep)
        if len(plan.keep) + len(plan.admit) > self.rows:
            raise RuntimeError(f"plan has {len(plan.keep) + len(plan.admit)} rows; the batch holds {self.rows}")
        local = []
        if plan.keep:
            local.append(self._decode(plan.tokens))
        if plan.admit:
            local.append(self._prefill(plan.admit, plan.images or (None,) * len(plan.admit)))
        scored = scored if self.engine.ctx.is_source else []
        if not local:
            return None, scored
        local = local[0] if len(local) == 1 else torch.cat(local)
        logits = self.engine.ctx.gather_to_source(local)  # (rows, vocab padded to the ranks)
        return (None if logits is None else logits[:, :self.engine.vocab_size]), scored

    def _score(self, tokens: tuple[int, ...]) -> torch.Tensor:
        """The logits of every position of `tokens`, on every rank (a forward pass of its own, nothing cached:
        reused prefixes have no logits)."""
        ids = torch.tensor([tokens], dtype=torch.long, device=self.model.device)
        return self.model.forward(ids)[0, :, :self.model.args.vocab_size]

    def _compact(self, keep: tuple[int, ...]) -> None:
        kept = set(keep)
        self._retain([row for row in range(len(self.cached)) if row not in kept])
        moves = [(dst, src) for dst, src in enumerate(keep) if dst != src]
        if moves:
            end = max(len(self.cached[src]) for _, src in moves)
            self.model.move_cache_rows([d for d, _ in moves], [s for _, s in moves], end)
        self.cached = [self.cached[src] for src in keep]

    def _retain(self, finished: list[int]) -> None:
        """Copy finished rows into the retained rows, before compaction overwrites them."""
        copies = {}  # retained row -> finished row (a later one wins a slot two want)
        for row in finished:
            slot = self.retained.keep(self.cached[row])
            if slot is not None:
                copies[slot] = row
        if copies:
            end = max(len(self.cached[src]) for src in copies.values())
            self.model.move_cache_rows(list(copies), list(copies.values()), end)

    def _decode(self, tokens: tuple[int, ...]) -> torch.Tensor:
        """This rank's logits (len(tokens), local vocab) of one token for each of the first len(tokens) rows."""
        n, device = len(tokens), self.model.device
        ends = [len(row) for row in self.cached]  # each row's next position
        width = _bucket(max(ends) + 1, self.columns)
        padded = self._padded_rows(n)  # rows past n decode junk at position 0; a prompt's copy or prefill follows
        token_ids = torch.zeros(padded, dtype=torch.long)
        token_ids[:n] = torch.tensor(tokens)
        positions = torch.zeros(padded, dtype=torch.long)
        positions[:n] = torch.tensor(ends)
        token_ids, positions = token_ids.to(device), positions.to(device)
        logits = self.engine.decode_step(token_ids, positions, decode_mask(positions, width))
        for row, token in zip(self.cached, tokens):
            row.append(token)
        return logits[:n]

    def _padded_rows(self, n: int) -> int:
        """On CUDA graphs, a power-of-two number of rows (few graphs to capture); otherwise exactly n."""
        if not (self.engine.settings.compile and self.model.device.type == "cuda"):
            return n
        return min(1 << (n - 1).bit_length(), self.rows)

    def _prefill(self, admit: tuple[tuple[int, ...], ...], images: tuple) -> torch.Tensor:
        """Write each prompt (with its image's pixels, or None) into its new row (after the current ones), reusing
        cached prefixes; this rank's logits (prompts, local vocab) of each prompt's last token."""
        prompts = [list(p) for p in admit]
        lengths = [len(p) for p in prompts]
        if min(lengths) < 1 or max(lengths) >= self.columns:
            raise ValueError(f"prompt lengths {lengths} must be in 1..{self.columns - 1} (the cache's columns)")
        first = len(self.cached)
        held = [self._contents(prompt, image) for prompt, image in zip(prompts, images)]
        plans = (plan_reuse(held, self.cached, self.retained, self.model.reusable_prefix)
                 if self.engine.settings.prefix_cache else [None] * len(prompts))
        self.cached += held
        pasts = [plan.length if plan else 0 for plan in plans]
        order, logits = [], []
        for wave in waves(plans):  # a prompt copying from one admitted with it waits for that one's prefill
            self._copy_prefixes([(first + i, plans[i]) for i in wave if plans[i] is not None])
            for group in _packed_groups([lengths[i] - pasts[i] for i in wave], PREFILL_TOKENS):
                members = [wave[j] for j in group]
                logits.append(self._prefill_packed([(prompts[i], first + i, pasts[i], images[i]) for i in members]))
                order += members
        self.engine.stats.prefilled_tokens += sum(lengths) - sum(pasts)
        self.engine.stats.reused_tokens += sum(pasts)
        logits = torch.cat(logits)
        return logits if order == sorted(order) else logits[torch.tensor(order, device=logits.device).argsort()]

    def _contents(self, prompt: list[int], image) -> list[int]:
        """What a row holds, as the prefix cache compares it: the prompt's tokens, an image's positions keyed by
        the image itself (negative: no token has such an id), so that only the same image is ever reused."""
        if image is None:
            return prompt
        key = -1 - image_key(image)
        return [key if token == self.model.image_token else token for token in prompt]

    def _copy_prefixes(self, copies: list) -> None:
        """Copy each (row, Reuse)'s prefix from its source row."""
        if copies:
            self.model.move_cache_rows([row for row, _ in copies], [plan.source for _, plan in copies],
                                       max(plan.length for _, plan in copies))
            for _, plan in copies:
                self.retained.used(plan.source)

    def _prefill_packed(self, parts: list[tuple[list[int], int, int, Optional[torch.Tensor]]]) -> torch.Tensor:
        """Prefill (prompt, row, past, image) parts packed into one sequence: each prompt's tokens from `past` on."""
        tokens = torch.tensor([t for prompt, _, past, _ in parts for t in prompt[past:]], dtype=torch.long,
                              device=self.model.device)
        segments, start = [], 0
        for prompt, row, past, _ in parts:
            segments.append(Segment(start, len(prompt) - past, row, past))
            start += len(prompt) - past
        return self.model.prefill(tokens, segments, [image for *_, image in parts])


def compiled(decode, device: torch.device):
    """`decode` under torch.compile, as one graph with symbolic sizes (rows and columns vary as requests come and
    go; a size of 1 gets its own graph), captured as CUDA graphs on CUDA (one per shape the buckets allow). On the
    CPU, inductor's wrapper that calls the graph's kernels is C++ (`cpp_wrapper`), not Python: with about 150 calls
    per step, 1.7 ms less per step here.

    Guards: dynamo re-checks every module attribute the step reads on every call (about 1 ms here). Only tensor
    guards are kept, on every tensor but the parameters (the inputs, the KV cache, the quantized weights): a
    loaded model's parameters and attributes never change, and whatever else might is a tensor.

    Sizes: the rows decoded and the KV cache's rows are independent, though often equal when a graph is traced;
    without duck shapes they get symbols of their own (else the graph took them for one size, and a later call where
    they differ failed its size checks: guards on sizes are among those dropped)."""
    options = {"guard_filter_fn": torch.compiler.keep_tensor_guards_unsafe}
    if device.type == "cuda":
        options["triton.cudagraphs"] = True
    else:
        options["cpp_wrapper"] = True
    step = torch.compile(decode, fullgraph=True, dynamic=True, options=options)

    def call(*args):
        with fx_config.patch(use_duck_shape=False):
            return step(*args)

    return call


def _where(place: int) -> str:
    return f"generation call {place >> 32}, step {place & 0xFFFFFFFF}"


def _bucket(columns: int, limit: int) -> int:
    """A power of two >= columns (at least MIN_COLUMNS), at most `limit`."""
    return min(max(MIN_COLUMNS, 1 << (columns - 1).bit_length()), limit)


def _packed_groups(lengths: list[int], budget: int) -> list[list[int]]:
    """Consecutive indices of `lengths` in groups of at most `budget` tokens (a longer prompt alone)."""
    groups, current, total = [], [], 0
    for i, n in enumerate(lengths):
        if current and total + n > budget:
            groups.append(current)
            current, total = [], 0
        current.append(i)
        total += n
    return groups + [current]
