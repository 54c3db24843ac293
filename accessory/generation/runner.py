"""Many prompts through the engine, continuously batched: at most `max_batch_size` rows at a time, text per row.

`generate`, `stream_generate`, `chat` and `stream_chat` are all thin consumers of `stream_rows`, so they share one
stop-token set, one stop-string rule and one truncation policy.
"""
from __future__ import annotations

import logging
from typing import Collection, Iterator, Sequence

from accessory.generation.engine import lockstep
from accessory.generation.sampling import SamplingParams
from accessory.generation.scheduler import Request, Scheduler, row_seeds

log = logging.getLogger(__name__)
TRUNCATE_POLICIES = ("left", "error")


def fit_prompt(tokens: list[int], params: SamplingParams, max_seq_len: int, truncate: str, row: int) -> list[int]:
    """The long-input policy: a prompt plus max_gen_len must fit in max_seq_len. "left" keeps the prompt's last
    tokens (with a warning); "error" raises."""
    if truncate not in TRUNCATE_POLICIES:
        raise ValueError(f"truncate must be one of {TRUNCATE_POLICIES}, got {truncate!r}")
    room = max_seq_len - params.max_gen_len
    if room < 1:
        raise ValueError(f"max_gen_len ({params.max_gen_len}) must be below max_seq_len ({max_seq_len})")
    if len(tokens) <= room:
        return tokens
    if truncate == "error":
        raise ValueError(f"prompt {row} has {len(tokens)} tokens; with max_gen_len {params.max_gen_len} at most "
                         f"{room} fit in max_seq_len {max_seq_len} (pass truncate='left' to keep its end)")
    log.warning("prompt %d: %d tokens do not fit with max_gen_len %d in max_seq_len %d; keeping the last %d",
                row, len(tokens), params.max_gen_len, max_seq_len, room)
    return tokens[-room:]


def stream_rows(model, tokenizer, prompts: list[list[int]], params: SamplingParams, seed: int,
                stop_ids: Collection[int], stop_strings: Sequence[str], max_batch_size: int,
                keep_cache_bytes: int = 0) -> Iterator[list[dict]]:
    """Yield, whenever a row's text changes, one dict per prompt: {"text", "delta", "end_of_content",
    "finish_reason", "completion_tokens"} (on every rank: the source rank's events are broadcast with each step's
    plan). finish_reason is None until the row ends, then "stop" or "length".

    At most `max_batch_size` rows decode together; when one finishes, the next prompt takes its place at once.
    `text` is the row's text so far, `delta` what this step added; text that could still become a stop string, or
    is an incomplete UTF-8 character, is held back. A row's last dict has end_of_content True; it stays so (with an
    empty delta) while other rows go on.
    """
    for row, tokens in enumerate(prompts):
        if not tokens:
            raise ValueError(f"prompt {row} is empty after tokenization")
    ctx = model.ctx
    scheduler = None
    if ctx.is_source:
        scheduler = Scheduler(tokenizer, stop_ids, max_batch_size, model.args.vocab_size, model.rotations.device)
        for row, (tokens, row_seed) in enumerate(zip(prompts, row_seeds(seed, len(prompts)))):
            scheduler.add(Request(row, tokens, params, row_seed, stop_strings))
        scheduler.close()
    events = [{"text": "", "delta": "", "end_of_content": False, "finish_reason": None, "completion_tokens": 0}
              for _ in prompts]
    columns = max(map(len, prompts)) + params.max_gen_len
    for plan in lockstep(model, ctx, scheduler, min(len(prompts), max_batch_size), columns, keep_cache_bytes):
        if plan.events:
            changed = dict(plan.events)
            events = [changed[row] if row in changed else {**event, "delta": ""}
                      for row, event in enumerate(events)]
            yield events

