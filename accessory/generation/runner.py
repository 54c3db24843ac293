"""Many prompts through the engine: waves of at most `max_batch_size` rows, text per row, events per step.

`generate`, `stream_generate`, `chat` and `stream_chat` are all thin consumers of `stream_rows`, so they share one
stop-token set, one stop-string rule and one truncation policy.
"""
from __future__ import annotations

import logging
from typing import Collection, Iterator, Sequence

import torch

from accessory.generation.engine import decode_steps
from accessory.generation.sampling import SamplingParams
from accessory.generation.text import RowText

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
    """Yield after every decode step one dict per prompt: {"text", "delta", "end_of_content"}.

    `text` is the row's text so far, `delta` what this step added; text that could still become a stop string, or
    is an incomplete UTF-8 character, is held back. A row's last dict has end_of_content True; it stays so (with an
    empty delta) while other rows go on.
    """
    generator = torch.Generator(device=model.rotations.device).manual_seed(seed)  # one per call
    rows = [RowText(tokenizer, stop_strings) for _ in prompts]
    events = [{"text": "", "delta": "", "end_of_content": False} for _ in prompts]
    for start in range(0, len(prompts), max_batch_size):
        wave = list(range(start, min(len(prompts), start + max_batch_size)))
        stopped = [False] * len(wave)
        for step in decode_steps(model, [prompts[i] for i in wave], params, generator, stop_ids, stopped,
                                 keep_cache_bytes):
            for slot, row in enumerate(wave):
                if events[row]["end_of_content"]:
                    events[row] = {**events[row], "delta": ""}
                    continue
                if step[slot] is not None:
                    rows[row].push(step[slot])
                stopped[slot] = stopped[slot] or rows[row].stopped
                if stopped[slot]:
                    rows[row].finish()
                text = rows[row].text if stopped[slot] else rows[row].visible
                events[row] = {"text": text, "delta": text[len(events[row]["text"]):],
                               "end_of_content": stopped[slot]}
            yield events
