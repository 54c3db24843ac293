"""What global rank 0 plans: before any model loads, the options and the input checked and what is already done
read (JobPlan); once the pending records are rendered, their jobs shared out over the data-parallel groups."""
from __future__ import annotations

import heapq
import secrets
from dataclasses import dataclass, field
from pathlib import Path

from accessory.batch.errors import BatchInputError
from accessory.batch.rendering import Job
from accessory.batch.options import BatchOptions
from accessory.batch.output import OutputFiles
from accessory.batch.records import Record, check_images, read_records


@dataclass
class JobPlan:
    """What global rank 0 learns before any model is loaded."""
    records: list[Record]
    done: dict  # id -> finished row, from OUT and the parts
    check_nonce: str = field(default_factory=lambda: secrets.token_hex(8))

    @property
    def pending(self) -> list[Record]:
        return [r for r in self.records if r.id not in self.done]


def prepare(options: BatchOptions, max_gen_len: int) -> JobPlan:
    """Validate the options and the input, and read what is done; before any model is loaded."""
    if max_gen_len >= options.max_seq_len:
        raise BatchInputError(f"--max_gen_len ({max_gen_len}) must be below --max_seq_len ({options.max_seq_len})")
    if options.template is not None:
        from accessory.data.conversation import get_conversation

        try:
            get_conversation(options.template)
        except ValueError as e:
            raise BatchInputError(f"--template: {e}") from e
    if not Path(options.input).is_file():
        raise BatchInputError(f"--input {options.input}: no such file")
    if Path(options.output).resolve() == Path(options.input).resolve():
        raise BatchInputError(f"--output {options.output} is the input: the input is never overwritten")
    records = read_records(options.input)
    Path(options.output).parent.mkdir(parents=True, exist_ok=True)
    plan = JobPlan(records, OutputFiles(options.output).read_done({r.id for r in records}))
    check_images(options.input, plan.pending)
    return plan


def split_jobs(jobs: list[Job], dp_size: int, max_gen_len: int) -> list[list[Job]]:
    """Jobs for each data-parallel group, balanced by an estimate of each job's work (prompt tokens plus
    max_gen_len): the largest first, each to the least-loaded group. Each group's jobs stay in input order."""
    load = [(0, g) for g in range(dp_size)]
    groups: list[list[Job]] = [[] for _ in range(dp_size)]
    for job in sorted(jobs, key=lambda j: (-j.prompt_tokens, j.line)):
        work, g = heapq.heappop(load)
        groups[g].append(job)
        heapq.heappush(load, (work + job.prompt_tokens + max_gen_len, g))
    return [sorted(group, key=lambda j: j.line) for group in groups]
