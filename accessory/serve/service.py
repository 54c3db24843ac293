"""GenerationService: continuous batching for a model-parallel group that serves requests from other threads.

Every rank constructs it and calls `run()` in its main thread. The source rank also takes requests from any
thread (an HTTP server, a gradio UI): `submit` returns a `Handle` that yields the request's events as the batch
produces them; requests that arrive while others decode join the running batch at the next step. While idle the
source rank sends an empty plan every `heartbeat_s`, so the other ranks never time out in their collectives.
`shutdown()` (or SIGTERM / SIGINT after `install_signal_handlers()`) stops taking requests, lets the accepted ones
finish for up to `grace_s` seconds, cancels the rest, and ends `run()` on every rank.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import queue
import re
import secrets
import signal
import threading
import time
from typing import Callable, Optional, Sequence

from accessory.generation import constraints
from accessory.generation.chat import render_chat
from accessory.generation.constraints import Constraint
from accessory.generation.sampling import SamplingParams
from accessory.generation.requests import Event, Request, check_window, row_seeds
from accessory.network.memory import return_freed_memory
from accessory.parallel.watchdog import active_watchdog
from accessory.serve.metrics import Timing
from accessory.text.reasoning import ReasoningFormat, closes_reasoning, opens_reasoning

log = logging.getLogger(__name__)
SAMPLING_KEYS = ("max_gen_len", "temperature", "top_p", "top_k", "repetition_penalty", "min_p", "presence_penalty",
                 "frequency_penalty", "logit_bias", "logprobs", "prompt_logprobs")
STALL_S = 3.0  # a rank silent this long makes /health say 503 (it ends every rank at --rank-timeout)
TRIM_AFTER_CHARS = 100_000  # tokenizing a text this long leaves megabytes in the allocator's free lists


class QueueFull(Exception):
    """Too many requests are waiting; try again later (HTTP 429)."""


class ServiceClosed(Exception):
    """The service is shutting down and takes no new requests (HTTP 503)."""


class FieldError(ValueError):
    """A request's value that cannot be used; `field` names it (the HTTP API's `param`)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


class Handle:
    """One submitted request's `Event`s, in order, for each of its `count` completions (`index(event)` says which):
    each completion's last event has end_of_content True. Iterate it from a thread, or `async for` it from the event
    loop it was submitted with."""

    def __init__(self, request_id: str, count: int, prompt_tokens: int, cancel: Callable[[str], None],
                 loop: Optional[asyncio.AbstractEventLoop]):
        self.id, self.prompt_tokens, self._cancel, self._loop = request_id, prompt_tokens, cancel, loop
        self.ids = [request_id] if count == 1 else [f"{request_id}.{i}" for i in range(count)]
        self._index = {sample_id: i for i, sample_id in enumerate(self.ids)}
        self._events = asyncio.Queue() if loop is not None else queue.Queue()
        self._open = count  # completions not yet ended
        self.finished = False
        self.completion_tokens = dict.fromkeys(self.ids, 0)  # what each completion's events have counted so far
        self.prompt = ""  # a chat request's rendered prompt, which its reply continues

    def index(self, event: Event) -> int:
        return self._index[event.id]

    def deliver(self, event: Event) -> None:  # the engine's thread
        self.completion_tokens[event.id] = event.completion_tokens
        if self._loop is None:
            self._events.put(event)
            return
        try:
            self._loop.call_soon_threadsafe(self._events.put_nowait, event)
        except RuntimeError:  # the submitter's event loop is closed: nobody is left to read this
            pass

    def cancel(self) -> None:
        """Stop generating: the rows leave the batch at the next step (final "cancelled" events follow)."""
        if not self.finished:
            for sample_id in self.ids:
                self._cancel(sample_id)

    def _received(self, event: Event) -> Event:
        self._open -= event.end_of_content
        self.finished = self._open == 0
        return event

    def __iter__(self):
        while not self.finished:
            yield self._received(self._events.get())

    async def next_event(self) -> Event:
        return self._received(await self._events.get())

    async def __aiter__(self):
        while not self.finished:
            yield await self.next_event()


class GenerationService:
    def __init__(self, model, max_queue: int = 64, heartbeat_s: float = 2.0, grace_s: float = 30.0,
                 metrics: bool = False):
        """`model`: a MetaModel; its engine's max_batch_size rows decode together, over the whole max_seq_len.
        `metrics`: keep Prometheus metrics (`self.metrics`, on the source rank) and log a line per request."""
        self.model, self.engine, self.ctx = model, model.engine, model.ctx
        self.max_queue, self.grace_s = max_queue, grace_s
        self.rows, self.columns = self.engine.settings.max_batch_size, self.engine.max_seq_len
        self.scheduler = self.engine.scheduler(self.rows, idle_wait_s=heartbeat_s)
        self._handles: dict[str, Handle] = {}
        self._lock = threading.RLock()  # a signal handler on the main thread may take it while it is held
        self._ids = itertools.count()
        self.accepting = True
        self.shutdown_hooks: list[Callable[[], None]] = []  # called once when shutdown begins (stop listening)
        self.failed: Optional[str] = None  # why every request ended, when a rank was lost
        self.watchdog = active_watchdog()
        if self.watchdog is not None and self.ctx.is_source:
            self.watchdog.failure_hooks.append(self._fail_all)
        self.metrics = self._timings = None
        if metrics and self.ctx.is_source:
            from accessory.serve.metrics import Metrics

            self.metrics = Metrics(lambda: self.running, lambda: self.waiting, self.cache_usage, self.engine.stats)
            self._timings = {}  # handle id -> Timing

    # ---- the source rank, any thread ---------------------------------------------------------------------------

    def submit(self, prompt: str, sampling: Optional[dict] = None, stop: Sequence[str] = (),
               loop: Optional[asyncio.AbstractEventLoop] = None, special: bool = True, image=None,
               **options) -> Handle:
        """Queue a completion of `prompt`. `sampling`: SAMPLING_KEYS and "seed" (None: random); max_gen_len
        defaults to the rest of the window. `special=False`: special tokens' text in the prompt is plain text.
        `image` (a vision-language model): pixels (C, S, S) from `model.image_transform()`, placed where the prompt
        says "<image>" (`MetaModel.encode_prompt`). `options`: those of `submit_tokens`. Raises ValueError for bad
        parameters or a prompt that does not fit, QueueFull, or ServiceClosed."""
        tokens = self.encode(prompt, special, image is not None)
        return self.submit_tokens(tokens, sampling, stop, loop, images=None if image is None else [image], **options)

    def encode(self, prompt: str, special: bool = True, image: bool = False) -> list[int]:
        """The prompt's tokens (with BOS, and an image's tokens if `image`); ValueError if it surely cannot fit,
        before spending time on it."""
        self.check_fits(prompt)
        with _memory_returned(len(prompt)):
            return self.model.encode_prompt(prompt, image, special)

    def tokenize(self, text: str, bos: bool = True, special: bool = True) -> list[int]:
        """`text`'s tokens (BOS first if `bos`), held to the same limit as a prompt's."""
        self.check_fits(text)
        with _memory_returned(len(text)):
            return self.model.tokenizer.encode(text, bos, False, special=special)

    def check_fits(self, prompt: str) -> None:
        """ValueError for a text of more characters than the window's tokens can hold (checked before tokenizing
        it: a text the size of the body limit takes seconds and hundreds of megabytes to tokenize)."""
        per_token = self.model.tokenizer.max_token_chars
        if len(prompt) > self.columns * per_token:
            raise ValueError(f"the prompt has {len(prompt)} characters, more than {self.columns} tokens can hold "
                             f"(one holds at most {per_token}): this model's max_seq_len is {self.columns}")

    def submit_chat(self, messages: list[dict], sampling: Optional[dict] = None, template: Optional[str] = None,
                    stop: Sequence[str] = (), loop: Optional[asyncio.AbstractEventLoop] = None,
                    tools: Optional[list] = None, context: Optional[dict] = None,
                    reasoning: Optional[ReasoningFormat] = None, reasoning_budget: Optional[int] = None,
                    **options) -> Handle:
        """Queue the assistant's reply to OpenAI-style messages, in the model's chat template or a named
        LLaMA2-Accessory conversation template (whose stop symbols are added to `stop`). `tools`: function
        definitions, for a chat template that writes them; `context`: more variables for the chat template.
        `reasoning`: the markers of the reply's reasoning, which then comes before what `options`' constraint
        holds, and is closed after `reasoning_budget` tokens (constraints.after_reasoning); unless the prompt has
        closed the block already (then the reply is all answer)."""
        prompt, template_stops = render_chat(self.model.tokenizer, messages, template, tools, context)
        if reasoning is not None and not closes_reasoning(prompt, reasoning):
            options["constraint"] = constraints.after_reasoning(
                options.get("constraint"), (reasoning.start, reasoning.end), opens_reasoning(prompt, reasoning),
                reasoning_budget)
        handle = self.submit(prompt, sampling, [*template_stops, *stop], loop, **options)
        handle.prompt = str(prompt)
        return handle

    def submit_tokens(self, tokens: list[int], sampling: Optional[dict] = None, stop: Sequence[str] = (),
                      loop: Optional[asyncio.AbstractEventLoop] = None, **options) -> Handle:
        """Queue a completion of `tokens`; `options` as `submit_prompts`'."""
        return self.submit_prompts([tokens], sampling, stop, loop, **options)

    def submit_prompts(self, prompts: list[list[int]], sampling: Optional[dict] = None, stop: Sequence[str] = (),
                       loop: Optional[asyncio.AbstractEventLoop] = None, n: int = 1,
                       constraint: Optional[Constraint] = None, label: Optional[str] = None,
                       user: Optional[str] = None, images: Optional[list] = None, adapter: int = 0) -> Handle:
        """Queue `n` samples of a completion of each prompt: the handle's choice i * n + j is prompt i's sample j,
        whose seed is `row_seeds(seed, n)[j]` (so each is what that prompt alone gives, and sample 0 what n=1
        gives). Each is held to `constraint` if one is given. `label` (default: the request's id) and `user` name
        it in its log line. `images`: one per prompt (pixels or None), as `MetaModel.generate` takes them.
        `adapter`: the PEFT adapter the completions run with (i: the model's i-th lora_modules; 0: none)."""
        if not self.ctx.is_source:
            raise RuntimeError("requests are submitted on the model-parallel source rank only")
        sampling = dict(sampling or {})
        seed = sampling.pop("seed", None)
        unknown = set(sampling) - set(SAMPLING_KEYS)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s) {sorted(unknown)}; known: {SAMPLING_KEYS} and seed")
        if not isinstance(n, int) or not 1 <= n <= self.rows:
            raise ValueError(f"n must be an integer in [1, {self.rows}] (the server's max_batch_size), got {n!r}")
        count = len(prompts) * n
        if not 1 <= count <= self.max_queue:
            raise ValueError(f"{len(prompts)} prompt(s) x n={n} is {count} completions; at most {self.max_queue} "
                             f"(the server's max_queue) per request")
        # a seed per sample; checked here, before anything is registered
        seeds = row_seeds(secrets.randbits(62) if seed is None else seed, n)
        sampling["logit_bias"] = self._logit_bias(sampling.get("logit_bias") or {})
        images = self.model.checked_images(images, len(prompts))
        self._check_adapter(adapter, sampling)
        params = [self._params(tokens, sampling, i if len(prompts) > 1 else None) for i, tokens in enumerate(prompts)]
        matchers = [self._matcher(constraint) for _ in range(count)]  # a schema that cannot compile raises here
        with self._lock:
            if not self.accepting:
                raise ServiceClosed("the server is shutting down")
            if self.waiting + count > self.max_queue:
                raise QueueFull(f"{self.waiting} requests are waiting and this one adds {count}; at most "
                                f"{self.max_queue} may wait: try again later")
            handle = Handle(f"{next(self._ids)}-{secrets.token_hex(6)}", count, sum(map(len, prompts)),
                            self.scheduler.cancel, loop)
            self._handles.update(dict.fromkeys(handle.ids, handle))
            rows = [Request(handle.ids[k], prompts[k // n], params[k // n], seeds[k % n], [s for s in stop if s],
                            matchers[k], image=images[k // n], adapter=adapter) for k in range(count)]
            if self.metrics is not None:
                self._timings[handle.id] = Timing(label or handle.id, handle.prompt_tokens, rows, user)
        for row in rows:
            self.scheduler.add(row)
        return handle

    def _check_adapter(self, adapter: int, sampling: dict) -> None:
        names = self.model.adapter_names
        if not isinstance(adapter, int) or isinstance(adapter, bool) or not 0 <= adapter <= len(names):
            raise ValueError(f"adapter must be 0 (none) or 1..{len(names)} (the model's lora_modules {list(names)}), "
                             f"got {adapter!r}")
        if adapter and sampling.get("prompt_logprobs") is not None:  # the engine scores prompts with the base
            raise ValueError("prompt log-probabilities (echo with logprobs) are not available with a LoRA adapter")

    def _params(self, tokens: list[int], sampling: dict, index: Optional[int]) -> SamplingParams:
        """The prompt's sampling parameters (max_gen_len: by default the rest of the window); it must fit."""
        which = "the prompt" if index is None else f"prompt {index}"
        if not tokens:
            raise ValueError(f"{which} is empty")
        params = SamplingParams(**{"max_gen_len": max(self.columns - len(tokens), 1), **sampling})
        check_window(len(tokens), params.max_gen_len, self.columns, which, names=(None, "this model's max_seq_len"))
        return params

    def _matcher(self, constraint: Optional[Constraint]):
        if constraint is None:
            return None
        return constraints.start(constraint, self.model.tokenizer, self.vocab_size, self.engine.stop_ids)

    def _logit_bias(self, bias: dict) -> tuple[tuple[int, float], ...]:
        """{token id (an int or its decimal text, as JSON keys are): bias} -> sorted pairs; ids must exist."""
        pairs = []
        for key, value in bias.items():
            token = int(key) if isinstance(key, str) and key.strip().isdigit() else key
            if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < self.vocab_size:
                raise FieldError("logit_bias", f"{key!r} is not a token id of this model (0 to "
                                               f"{self.vocab_size - 1})")
            pairs.append((token, value))
        return tuple(sorted(pairs))

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    def shutdown(self) -> None:
        """Take no new requests; finish the accepted ones (cancelled after grace_s); then `run()` returns."""
        with self._lock:
            if not self.accepting:
                return
            self.accepting = False
        log.info("shutting down: finishing %d request(s), at most %.0f s", len(self._handles), self.grace_s)
        for hook in self.shutdown_hooks:
            hook()
        self.scheduler.close()
        timer = threading.Timer(self.grace_s, self._cancel_all)
        timer.daemon = True
        timer.start()

    def _cancel_all(self) -> None:
        with self._lock:
            ids = list(self._handles)
        for request_id in ids:
            self.scheduler.cancel(request_id)

    def _fail_all(self, reason: str) -> None:
        """A rank is lost and every rank is about to exit: end each open request with an error event (the reason
        without the file paths a collective's error names: the log has them)."""
        reason = without_paths(reason)
        with self._lock:
            self.failed, self.accepting = reason, False
            handles, self._handles = list(self._handles.values()), {}
        for handle in set(handles):
            for sample_id in handle.ids:
                handle.deliver(Event(sample_id, "", "", True, "error", handle.completion_tokens[sample_id], reason))

    def health(self) -> tuple[bool, dict]:
        """(healthy, what /health says): not while draining for shutdown, nor while a rank is silent for STALL_S
        or has been lost."""
        report = {"status": "ok", "running": self.running, "waiting": self.waiting}
        if self.failed:
            return False, {**report, "status": "failed", "error": self.failed}
        silent = self.watchdog.silent_ranks(STALL_S) if self.watchdog is not None else {}
        if silent:
            return False, {**report, "status": "stalled",
                           "silent_ranks": {str(r): round(s, 1) for r, s in sorted(silent.items())}}
        if not self.accepting:  # a load balancer sends new requests elsewhere while these finish
            return False, {**report, "status": "draining"}
        return True, report

    @property
    def waiting(self) -> int:
        """Requests not yet in the batch."""
        return self.scheduler.intake.queued()

    @property
    def running(self) -> int:
        """Samples accepted and not yet finished (waiting or in the batch)."""
        return len(self._handles)

    # ---- every rank, main thread ---------------------------------------------------------------------------------

    def run(self) -> None:
        """Drive the batch until shutdown; on the source rank, deliver each step's events to their handles."""
        try:
            for events in self.engine.run(self.scheduler, self.rows, self.columns):
                for event in events:
                    self._deliver(event)
        except BaseException as e:  # a rank failed or left: the open requests end with an error, not a cut stream
            reason = f"the model-parallel group failed: {type(e).__name__}: {e}"
            silent = self.watchdog.silent_ranks(STALL_S) if self.watchdog is not None else {}
            if silent:  # a peer's watchdog may have ended the lost rank before this rank's did: say which it was
                rank = max(silent, key=silent.get)
                reason = f"rank {rank} has not answered for {silent[rank]:.0f} s (frozen or lost); {reason}"
            self._fail_all(reason)
            raise
        log.info("generation service stopped")

    def _deliver(self, event: Event) -> None:
        with self._lock:
            handle = self._handles.get(event.id)
            if handle is not None and event.end_of_content:
                del self._handles[event.id]
            ended = handle is not None and not any(i in self._handles for i in handle.ids)
        if handle is not None:
            handle.deliver(event)
            if self.metrics is not None:
                self._measure(handle, event, ended)

    def _measure(self, handle: Handle, event: Event, ended: bool) -> None:
        timing, now = self._timings.get(handle.id), time.monotonic()
        if timing is None:
            return
        self.metrics.progress(timing, event.id, event.completion_tokens, now)
        if ended:
            del self._timings[handle.id]
            self.metrics.ended(timing, event.finish_reason, now)

    def cache_usage(self) -> float:
        """The fraction of the KV cache's positions that the rows in the batch hold."""
        active = self.scheduler.intake.in_batch()
        return sum(len(r.tokens) + len(r.generated) for r in active) / (self.rows * self.columns)

    def install_signal_handlers(self) -> None:
        """SIGTERM and SIGINT shut the service down from the source rank. The other ranks ignore them: torchrun
        sends them to every rank, and they end when the source rank's last plan says so."""
        def on_signal(signum, frame):
            log.info("received %s", signal.Signals(signum).name)
            self.shutdown()

        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, on_signal if self.ctx.is_source else signal.SIG_IGN)


SOURCE_LOCATION = re.compile(r"\[[^\]\s]*/[^\]\s]*\]\s*")  # "[/pytorch/third_party/gloo/.../pair.cc:534] "
FILE_PATH = re.compile(r"(?<![\w/.])/(?:[^\s/:'\"]+/)+[^\s:'\"]*(?::\d+)?")  # "/home/me/x.py:12"


def without_paths(message: str) -> str:
    """`message` for clients: without the source files and paths of this machine that errors name."""
    return FILE_PATH.sub("<path>", SOURCE_LOCATION.sub("", message))


@contextlib.contextmanager
def _memory_returned(chars: int):
    """After tokenizing a long text, hand the memory it freed back to the system: glibc keeps what a worker
    thread frees in that thread's arena (a 7M-character prompt left 660 MB of it)."""
    try:
        yield
    finally:
        if chars > TRIM_AFTER_CHARS:
            return_freed_memory()
