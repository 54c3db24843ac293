"""What the engine is asked and what it answers: a `Request` (one sequence to complete, with its sampling
parameters, seed, stops, constraint and image, and the text state the scheduler and a Follower keep alike), the
`Event`s a stream yields, per-token log-probabilities, and the prompt policies (a seed per row, fitting a prompt in
the context)."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

from accessory.generation.constraints import Matcher
from accessory.generation.detokenizer import RowText
from accessory.generation.sampling import SamplingParams

log = logging.getLogger(__name__)
# How a request ended, as a plan sends it (0: it goes on). "error": this request failed; the others go on.
FINISH_CODES = {None: 0, "stop": 1, "length": 2, "cancelled": 3, "error": 4}
FINISH_REASONS = {code: reason for reason, code in FINISH_CODES.items()}
TRUNCATE_POLICIES = ("left", "error")


@dataclass(frozen=True)
class Event:
    """What a caller sees of one request after a step: its text so far, what this step added, and whether (and
    why) it ended. `event["text"]` works too, as LLaMA2-Accessory's dicts did."""
    id: Any
    text: str = ""
    delta: str = ""
    end_of_content: bool = False
    finish_reason: Optional[str] = None  # None until the request ends, then a key of FINISH_CODES
    completion_tokens: int = 0
    error: Optional[str] = None  # what went wrong, when finish_reason is "error"
    logprobs: tuple["TokenLogprob", ...] = ()  # of the tokens sampled since the last event (if asked for)
    prompt_logprobs: Optional[tuple["TokenLogprob", ...]] = None  # once, if asked for: each prompt token's
    stop_string: Optional[str] = None  # the stop string that ended it (None: a stop token, or another reason)

    def __getitem__(self, key: str):
        return getattr(self, key)


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability under the model (its raw logits: before penalties, temperature or a constraint),
    and the `top` most likely tokens' (token, log-probability), most likely first. A prompt's first token has no
    context: its logprob is None."""
    token: int
    logprob: Optional[float]
    top: tuple[tuple[int, float], ...] = ()


SEED_RANGE = (-2 ** 63, 2 ** 64)  # what a torch.Generator takes


def row_seeds(seed: int, n: int) -> list[int]:
    """A seed per row from one call's seed: row i's draws do not depend on how many rows run beside it."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not SEED_RANGE[0] <= seed < SEED_RANGE[1]:
        raise ValueError(f"seed must be an integer in [-2**63, 2**64), got {seed!r}")
    return torch.randint(0, 2 ** 62, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


IMAGE_NEVER_CUT = ", and a prompt with an image is never truncated"  # that would cut the image


def fits_window(prompt_tokens: int, max_gen_len: int, max_seq_len: int) -> bool:
    """Whether a prompt of `prompt_tokens` leaves room for max_gen_len generated tokens in max_seq_len."""
    return prompt_tokens + max_gen_len <= max_seq_len


def check_window(prompt_tokens: int, max_gen_len: int, max_seq_len: int, which: str, *,
                 names: tuple[Optional[str], str] = ("max_gen_len", "max_seq_len"), why: str = "",
                 error: type[ValueError] = ValueError) -> None:
    """Raises `error` unless `which`, a prompt of `prompt_tokens`, fits the window with max_gen_len generated tokens.
    The message calls the two settings what the caller's user knows them as (`names`; None: the generated tokens'
    count has no name there) and ends with `why`."""
    if fits_window(prompt_tokens, max_gen_len, max_seq_len):
        return
    gen_name, window_name = names
    generating = f"{gen_name} {max_gen_len}" if gen_name else f"{max_gen_len} to generate"
    raise error(f"{which} has {prompt_tokens} tokens; with {generating} at most {max_seq_len - max_gen_len} fit in "
                f"{window_name} {max_seq_len}{why}")


def fit_prompt(tokens: list[int], params: SamplingParams, max_seq_len: int, truncate: str, row: int,
               image_tokens: int = 0) -> list[int]:
    """The long-input policy: a prompt plus max_gen_len must fit in max_seq_len. "left" keeps the prompt's last
    tokens (with a warning); "error" raises. A prompt with an image (`image_tokens` of its tokens) must fit whole."""
    if image_tokens:
        check_window(len(tokens), params.max_gen_len, max_seq_len, f"prompt {row} with its image ({image_tokens} "
                     f"tokens)", why=IMAGE_NEVER_CUT)
    if truncate not in TRUNCATE_POLICIES:
        raise ValueError(f"truncate must be one of {TRUNCATE_POLICIES}, got {truncate!r}")
    room = max_seq_len - params.max_gen_len
    if room < 1:
        raise ValueError(f"max_gen_len ({params.max_gen_len}) must be below max_seq_len ({max_seq_len})")
    if len(tokens) <= room:
        return tokens
    if truncate == "error":  # raises: the prompt does not fit
        check_window(len(tokens), params.max_gen_len, max_seq_len, f"prompt {row}",
                     why=" (pass truncate='left' to keep its end)")
    log.warning("prompt %d: %d tokens do not fit with max_gen_len %d in max_seq_len %d; keeping the last %d",
                row, len(tokens), params.max_gen_len, max_seq_len, room)
    return tokens[-room:]


@dataclass
class Request:
    """One sequence to complete, with its own sampling parameters, seed and stop strings. `tokens` must leave room
    for `params.max_gen_len` in the batch's columns."""
    id: Any
    tokens: list[int]
    params: SamplingParams
    seed: int
    stop_strings: Sequence[str] = ()
    matcher: Optional[Matcher] = field(default=None, repr=False)  # the constraint the output must match
    # the prompt's image, transformed (C, S, S) on the CPU, filling its image tokens (a vision-language model's)
    image: Optional[torch.Tensor] = field(default=None, repr=False)
    adapter: int = 0  # the PEFT adapter it runs with (lora_modules: 1, 2, ...), 0: the base model
    # state, kept by the scheduler
    text: Optional[RowText] = field(default=None, repr=False)
    generator: Optional[torch.Generator] = field(default=None, repr=False)
    finish_reason: Optional[str] = None
    shown: str = ""  # the text callers have been sent
    logprobs: list[TokenLogprob] = field(default_factory=list, repr=False)  # not yet sent
    admitted_at: Optional[float] = None  # time.monotonic() when it joined the batch
    prompt_logprobs: Optional[tuple] = None  # computed, not yet sent

    pushed: list[int] = field(default_factory=list)  # the tokens that joined the text in the current step
    proposed_tokens: int = 0  # speculative decoding: tokens proposed for this request, and of those, accepted
    accepted_tokens: int = 0

    # ---- the text and events callers see: the scheduler and a Follower write them alike ---------------------------

    def start_text(self, tokenizer) -> None:
        self.text = RowText(tokenizer, self.stop_strings)

    def push(self, token: int) -> None:
        self.text.push(token)
        self.pushed.append(token)

    def finish(self, reason: str, events: list) -> None:
        self.finish_reason = reason
        self.text.finish()
        self.emit(events)

    def fail(self, message: str, events: list) -> None:
        """End with finish_reason "error", keeping the text its caller was already sent."""
        self.finish_reason = "error"
        events.append(Event(self.id, self.shown, "", True, "error", len(self.generated), message))

    def emit(self, events: list) -> None:
        """An event when the text callers may see grew, and always at the end."""
        ended = self.finish_reason is not None
        text = self.text.text if ended else self.text.visible
        if text == self.shown and not ended:
            return
        events.append(Event(self.id, text, text[len(self.shown):], ended, self.finish_reason, len(self.generated),
                            logprobs=tuple(self.logprobs), prompt_logprobs=self.prompt_logprobs,
                            stop_string=self.text.stop_string if ended else None))
        self.shown, self.logprobs, self.prompt_logprobs = text, [], None

    @property
    def plain_greedy(self) -> bool:
        """Its token is the argmax of the raw logits (such rows are chosen all at once)."""
        return self.params.greedy and not self.params.penalized and self.matcher is None

    @property
    def generated(self) -> list[int]:
        return self.text.ids if self.text is not None else []
