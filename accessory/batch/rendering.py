"""A pending record as the engine will see it (Job): "messages" rendered with the conversation template, the
template's stop strings, and the prompt's tokens counted exactly as generation encodes it; and the check that a
prompt with an image fits whole."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from accessory.batch.errors import BatchInputError
from accessory.batch.records import Record, RecordId
from accessory.errors import AccessoryError
from accessory.generation.requests import IMAGE_NEVER_CUT, check_window

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Job:
    """A pending record, rendered to the prompt the engine sees: what a group needs to generate it."""
    line: int  # the record's input line: groups work in input order
    id: RecordId
    prompt: str
    stops: tuple[str, ...]  # stop strings of its conversation template; () for a plain prompt
    prompt_tokens: int  # an image's tokens included
    image: Optional[Path] = None  # read on its group's source rank when its chunk is generated


def render_jobs(tokenizer, records: list[Record], template: Optional[str],
                encode_prompt: Optional[Callable] = None) -> list[Job]:
    """Each pending record as the prompt text the engine will see, its stop strings, and its token count (encoded
    exactly as generation encodes it: `encode_prompt(prompt, image)`, the model's, counts an image's tokens; without
    it a record with an image is an error)."""
    from accessory.generation.chat import render_chat, with_image_placeholder

    if template is None and not tokenizer.has_chat_template and any(r.messages is not None for r in records):
        log.info("the model has no chat template; rendering \"messages\" with LLaMA2-Accessory's default "
                 "conversation")
        template = "default"  # what render_chat falls back to, named here so it says so once, not per record
    encode_prompt = encode_prompt or _text_only(tokenizer)
    jobs = []
    for record in records:
        prompt, stops = record.prompt, ()
        try:
            if record.messages is not None:
                messages = record.messages if record.image is None else with_image_placeholder(record.messages)
                prompt, stop_list = render_chat(tokenizer, messages, template)
                stops = tuple(stop_list)
            tokens = encode_prompt(prompt, record.image is not None)
        except (AccessoryError, ValueError) as e:
            raise BatchInputError(f"input line {record.line}: record {record.id!r}: {e}") from e
        jobs.append(Job(record.line, record.id, prompt, stops, len(tokens), record.image))
    return jobs


def _text_only(tokenizer) -> Callable:
    def encode(prompt: str, image: bool) -> list[int]:
        if image:
            raise ValueError("has an \"image\", but no model to place it was given")
        return tokenizer.encode(prompt, bos=True, eos=False)
    return encode


def check_room(jobs: list[Job], max_gen_len: int, max_seq_len: int) -> None:
    """A prompt with an image is never truncated (that would cut the image): it must fit whole with max_gen_len."""
    for job in jobs:
        if job.image is not None:
            check_window(job.prompt_tokens, max_gen_len, max_seq_len, f"input line {job.line}: record {job.id!r}: "
                         f"its prompt with its image", names=("--max_gen_len", "--max_seq_len"), why=IMAGE_NEVER_CUT,
                         error=BatchInputError)
