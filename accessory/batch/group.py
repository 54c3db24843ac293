"""One data-parallel group's share of the job, on every rank of the group: the jobs generated a chunk at a time,
each with its own stop strings, their images read on the group's source rank, which appends each finished row to
the group's part the moment it ends."""
from __future__ import annotations

import sys
import time
from typing import Callable, Optional

import torch

from accessory.batch.errors import BatchInputError
from accessory.batch.rendering import Job
from accessory.batch.options import BatchOptions
from accessory.batch.output import OutputFiles, PartWriter, output_row
from accessory.batch.summary import GroupStats
from accessory.data.images import ImageError, read_image_file
from accessory.generation.requests import Event
from accessory.parallel.context import GroupLayout
from accessory.runtime.images import image_pixels

CHUNK_BATCHES = 16  # records per stream_generate call, in units of --batch_size: bounds the per-step event list


def run_group(model, layout: GroupLayout, jobs: list[Job], options: BatchOptions, sampling: dict,
              leader: bool) -> GroupStats:
    """This group's share: every rank generates, the group's source appends each finished row to its part."""
    from tqdm import tqdm

    stats = GroupStats(records=len(jobs), prompt_tokens=sum(j.prompt_tokens for j in jobs))
    source = model.ctx.is_source
    writer = PartWriter(OutputFiles(options.output).part(layout.dp_rank)) if source and jobs else None
    # One bar, on global rank 0: other groups' bars would garble each other on the shared terminal.
    bar = tqdm(total=len(jobs), disable=not leader, unit="record", file=sys.stderr,
               desc=f"batch (group 0 of {layout.dp_size})" if layout.dp_size > 1 else "batch")

    def on_done(job: Job, event: Event) -> None:
        if writer is not None:
            stats.output_tokens += event.completion_tokens
            stats.failed += event.error is not None
            writer.write(output_row(job, event, sampling["max_gen_len"], options.max_seq_len))
        bar.update(1)

    start = time.perf_counter()
    try:
        if jobs:
            generate_jobs(model, jobs, sampling, options.batch_size, on_done, options.image_transform)
    finally:
        if writer is not None:
            writer.close()
        bar.close()
    stats.seconds = time.perf_counter() - start
    return stats


def generate_jobs(model, jobs: list[Job], sampling: dict, batch_size: int,
                  on_done: Callable[[Job, Event], None], image_transform: str = "padded_resize") -> None:
    """Generate every job, each with its own stop strings; `on_done(job, last event)` as each one ends, while the
    others go on (on the source rank; the other ranks hear of each chunk's ends when it is over)."""
    chunk = batch_size * CHUNK_BATCHES
    for start in range(0, len(jobs), chunk):
        part = jobs[start: start + chunk]
        written = [False] * len(part)
        images = chunk_images(model, part, image_transform)
        for events in model.stream_generate([j.prompt for j in part], image=images,
                                            additional_stop_symbols=[list(j.stops) for j in part], **sampling):
            for k, event in enumerate(events):
                if event.end_of_content and not written[k]:
                    written[k] = True
                    on_done(part[k], event)
        assert all(written), "stream_generate ended before every row's end_of_content"


def chunk_images(model, jobs: list[Job], transform: str) -> Optional[list]:
    """The jobs' pixels (None for a job without an image), read and transformed on the group's source rank, which
    sends them with the prompts; None elsewhere, or when no job has an image. A file that changed since it was
    checked stops the group's every rank."""
    if all(job.image is None for job in jobs):
        return None

    def read(job: Job) -> Optional[torch.Tensor]:
        if job.image is None:
            return None
        where = f"input line {job.line}: record {job.id!r}: \"image\""
        try:
            return image_pixels(model, lambda: read_image_file(job.image), transform, where)
        except ImageError as e:
            raise BatchInputError(str(e)) from None

    return model.ctx.on_rank0(lambda: [read(job) for job in jobs])

