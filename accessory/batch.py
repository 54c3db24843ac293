"""`accessory batch`: every record of a JSONL file through the model, on a torchrun world split as data-parallel x
model-parallel, written as JSONL; resumable after any crash.

Files, for `--output OUT`:

    OUT.part-G   the records data-parallel group G has finished, one JSON line each, appended and flushed the
                 moment a record ends. Only group G's source rank writes it, so groups never interleave lines.
    OUT          the final output, written by global rank 0 when every record is done: one line per input record,
                 in input order, through OUT.merging and a rename (readers never see half of it); the parts are
                 removed after the rename.
    OUT.shared-check   written by global rank 0 and read by each group's source before any model loads, so that
                 an OUT on a disk some machine cannot see is refused at once; removed right after.

A rerun reads OUT and every OUT.part-* to learn which ids are done and generates only the others. A last line
without its newline (a process killed mid-write) is dropped and regenerated; any other line that is not a record
of this input is an error. The input file is only ever read.
"""
from __future__ import annotations

import heapq
import json
import logging
import os
import secrets
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Union

import torch
import torch.distributed as dist

from accessory.data.images import ImageError, read_image_file
from accessory.errors import AccessoryError
from accessory.generation.requests import Event
from accessory.parallel.context import GroupLayout, ParallelContext, data_parallel_layout

log = logging.getLogger(__name__)

RecordId = Union[str, int]
RECORD_KEYS = ("id", "prompt", "messages", "image")
EXPECTED = ('one JSON object per line, {"id": string or integer, "prompt": string} or '
            '{"id": ..., "messages": [{"role": "system"|"user"|"assistant", "content": string}, ...]}, '
            'each with an optional "image": "path/to/file"')
JSON_TYPES = {dict: "object", list: "array", str: "string", int: "number", float: "number", bool: "boolean",
              type(None): "null"}
CHUNK_BATCHES = 16  # records per stream_generate call, in units of --batch_size: bounds the per-step event list


class BatchInputError(AccessoryError, ValueError):
    """An input record, output file or option of `accessory batch` that cannot be used as it is."""


@dataclass(frozen=True)
class BatchOptions:
    input: Path
    output: Path
    mp: int = 1  # model-parallel size; the data-parallel size is world / mp
    batch_size: int = 8  # rows in flight per model-parallel group
    template: Optional[str] = None  # a conversation template name; None: the model's own chat template
    max_seq_len: int = 4096
    image_transform: str = "padded_resize"  # for records with an image (a vision-language model)


@dataclass(frozen=True)
class Record:
    line: int  # 1-based line number in the input
    id: RecordId
    prompt: Optional[str] = None
    messages: Optional[list] = None
    image: Optional[Path] = None  # an image file, relative paths already resolved against the input's folder


@dataclass(frozen=True)
class Job:
    """A pending record, rendered to the prompt the engine sees: what a group needs to generate it."""
    line: int  # the record's input line: groups work in input order
    id: RecordId
    prompt: str
    stops: tuple[str, ...]  # stop strings of its conversation template; () for a plain prompt
    prompt_tokens: int  # an image's tokens included
    image: Optional[Path] = None  # read on its group's source rank when its chunk is generated


@dataclass
class GroupStats:
    records: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    seconds: float = 0.0


@dataclass
class JobPlan:
    """What global rank 0 learns before any model is loaded."""
    records: list[Record]
    done: dict  # id -> finished row, from OUT and the parts
    check_nonce: str = field(default_factory=lambda: secrets.token_hex(8))

    @property
    def pending(self) -> list[Record]:
        return [r for r in self.records if r.id not in self.done]


# ---- input ----------------------------------------------------------------------------------------------------------

def read_records(path: Path) -> list[Record]:
    """Every record of the JSONL file `path`, validated; BatchInputError naming the line and what was expected."""
    try:
        raw_lines = Path(path).read_bytes().splitlines()
    except OSError as e:
        raise BatchInputError(f"--input {path}: cannot be read ({e.strerror or e})") from e
    records, first_line = [], {}
    for number, raw in enumerate(raw_lines, 1):
        if not raw.strip():
            continue  # blank lines (a trailing one, say) carry no record
        record = _parse_record(f"{path}:{number}", number, raw, Path(path).parent)
        if record.id in first_line:
            raise BatchInputError(f"{path}:{number}: duplicate id {record.id!r} (first on line "
                                  f"{first_line[record.id]}); ids must be unique, a rerun skips ids already written")
        first_line[record.id] = number
        records.append(record)
    if not records:
        raise BatchInputError(f"--input {path}: no records; expected {EXPECTED}")
    return records


def _parse_record(where: str, number: int, raw: bytes, folder: Path) -> Record:
    try:
        value = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise BatchInputError(f"{where}: not UTF-8 ({e.reason} at byte {e.start})") from e
    except json.JSONDecodeError as e:
        raise BatchInputError(f"{where}: not JSON ({e.msg} at column {e.colno}); expected {EXPECTED}") from e
    if not isinstance(value, dict):
        raise BatchInputError(f"{where}: a JSON {JSON_TYPES[type(value)]}; expected {EXPECTED}")
    unknown = sorted(set(value) - set(RECORD_KEYS))
    if unknown:
        raise BatchInputError(f"{where}: unknown key(s) {unknown}; a record has only \"id\", one of \"prompt\" "
                              f"or \"messages\", and \"image\"")
    if "id" not in value:
        raise BatchInputError(f"{where}: no \"id\"; expected {EXPECTED}")
    record_id = value["id"]
    if not _is_id(record_id):
        raise BatchInputError(f"{where}: \"id\" must be a string or an integer, got {json.dumps(record_id)}")
    if ("prompt" in value) == ("messages" in value):
        which = "both \"prompt\" and" if "prompt" in value else "neither \"prompt\" nor"
        raise BatchInputError(f"{where}: record {record_id!r} has {which} \"messages\"; expected exactly one")
    image = _image_path(where, record_id, value, folder)
    if "prompt" in value:
        if not isinstance(value["prompt"], str):
            raise BatchInputError(f"{where}: \"prompt\" of record {record_id!r} must be a string, got a JSON "
                                  f"{JSON_TYPES[type(value['prompt'])]}")
        return Record(number, record_id, prompt=value["prompt"], image=image)
    _check_messages(where, record_id, value["messages"])
    return Record(number, record_id, messages=value["messages"], image=image)


def _image_path(where: str, record_id: RecordId, value: dict, folder: Path) -> Optional[Path]:
    """The record's "image" file, a relative path taken from the input file's folder."""
    if "image" not in value:
        return None
    image = value["image"]
    if not isinstance(image, str) or not image:
        shown = "an empty string" if image == "" else f"a JSON {JSON_TYPES[type(image)]}"
        raise BatchInputError(f"{where}: \"image\" of record {record_id!r} must be the path of an image file, got "
                              f"{shown}")
    return folder / image


def _check_messages(where: str, record_id: RecordId, messages) -> None:
    from accessory.generation.chat import check_messages

    try:
        check_messages(messages)
    except ValueError as e:
        raise BatchInputError(f"{where}: \"messages\" of record {record_id!r}: {e}") from e


def _is_id(value) -> bool:
    return isinstance(value, (str, int)) and not isinstance(value, bool)  # True == 1 would collide with id 1


# ---- output files ---------------------------------------------------------------------------------------------------

class OutputFiles:
    """OUT, its per-group parts OUT.part-G, and the merge of the parts into OUT (see the module docstring)."""

    def __init__(self, output: Path):
        self.output = Path(output)

    def part(self, group: int) -> Path:
        return self.output.with_name(f"{self.output.name}.part-{group}")

    def parts(self) -> list[Path]:
        prefix = f"{self.output.name}.part-"
        return sorted(p for p in self.output.parent.glob("*.part-*")  # any group count: a rerun may change dp
                      if p.name.startswith(prefix) and p.name[len(prefix):].isdigit())

    @property
    def shared_check(self) -> Path:
        return self.output.with_name(f"{self.output.name}.shared-check")

    def read_done(self, input_ids: set) -> dict:
        """id -> row of every finished record in OUT and the parts (the first copy wins: a crash between the merge's
        rename and the removal of the parts leaves two equal ones). Torn last lines of parts are cut off here, before
        any group appends again."""
        done = {}
        for path in ([self.output] if self.output.exists() else []) + self.parts():
            for row in _read_rows(path, input_ids, repair=path != self.output):
                done.setdefault(row["id"], row)
        return done

    def merge(self, records: list[Record], done: dict) -> None:
        """Write OUT atomically with every record's row in input order, then remove the parts."""
        missing = [r.id for r in records if r.id not in done]
        if missing:
            raise BatchInputError(f"{len(missing)} record(s) have no output after every group finished (first: "
                                  f"{missing[:5]}); if the ranks run on several machines, --output "
                                  f"{self.output} must be on a filesystem they all share")
        merging = self.output.with_name(f"{self.output.name}.merging")
        with open(merging, "wb") as f:
            for record in records:
                f.write(_row_bytes(done[record.id]))
            f.flush()
            os.fsync(f.fileno())
        os.replace(merging, self.output)
        _fsync_dir(self.output.parent)
        for part in self.parts():
            part.unlink()


def _read_rows(path: Path, input_ids: set, repair: bool) -> list[dict]:
    try:
        data = path.read_bytes()
    except OSError as e:
        raise BatchInputError(f"{path}: cannot be read ({e.strerror or e})") from e
    end = data.rfind(b"\n") + 1
    if end < len(data):  # a process killed mid-write: drop the torn line; that record is generated again
        log.warning("%s: dropping an unfinished last line (%d bytes) left by an interrupted run", path,
                    len(data) - end)
        if repair:  # a part is appended to next: the new line must not be glued to the torn one
            os.truncate(path, end)
    rows = []
    for number, line in enumerate(data[:end].splitlines(), 1):
        row = _parse_row(f"{path}:{number}", line)
        if row["id"] not in input_ids:
            raise BatchInputError(f"{path}:{number}: id {row['id']!r} is not in the input; this file belongs to "
                                  f"another job: pass a different --output, or move it away")
        rows.append(row)
    return rows


def _parse_row(where: str, line: bytes) -> dict:
    try:
        row = json.loads(line)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BatchInputError(f"{where}: not a JSON line written by accessory batch ({e}); fix or remove it") from e
    if not isinstance(row, dict) or not _is_id(row.get("id")) or not isinstance(row.get("output"), str):
        raise BatchInputError(f"{where}: not an output row ({{\"id\", \"output\", ...}}); fix or remove it")
    return row


def _row_bytes(row: dict) -> bytes:
    # ASCII escapes (json's default): any str can be written, and one write() of whole bytes is the whole line
    return (json.dumps(row) + "\n").encode("ascii")


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename itself survives a power loss
    finally:
        os.close(fd)


class PartWriter:
    """Appends finished rows to one group's part, flushed per row, so a killed process loses no finished record."""

    def __init__(self, path: Path):
        self.file = open(path, "ab")

    def write(self, row: dict) -> None:
        self.file.write(_row_bytes(row))
        self.file.flush()

    def close(self) -> None:
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()


# ---- planning (global rank 0) ---------------------------------------------------------------------------------------

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


def check_images(path: Path, records: list[Record]) -> None:
    """Each record's image must read whole, before any model loads: a missing, unreadable or oversized file is named
    with its record's line. (Its pixels are made later, a chunk at a time: kept for every record they could fill
    the memory, 1.3 MB each at 336 x 336.)"""
    from tqdm import tqdm

    with_images = [r for r in records if r.image is not None]
    for record in tqdm(with_images, desc="checking images", unit="image", file=sys.stderr, delay=2):
        try:
            read_image_file(record.image)
        except ImageError as e:
            raise BatchInputError(f"{path}:{record.line}: \"image\" of record {record.id!r}: {e}") from None


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
        if job.image is not None and job.prompt_tokens + max_gen_len > max_seq_len:
            raise BatchInputError(f"input line {job.line}: record {job.id!r}: its prompt with its image is "
                                  f"{job.prompt_tokens} tokens; with --max_gen_len {max_gen_len} at most "
                                  f"{max_seq_len - max_gen_len} fit in --max_seq_len {max_seq_len}, and a prompt "
                                  f"with an image is never truncated")


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


# ---- generation (every rank of a group; its source writes) -----------------------------------------------------------

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
            return image_pixels(model, read_image_file(job.image), transform, where)
        except ImageError as e:
            raise BatchInputError(str(e) if str(e).startswith(where) else f"{where}: {e}") from None

    return on_rank0(model.ctx, lambda: [read(job) for job in jobs])


def image_pixels(model, image, transform: str, what: str) -> torch.Tensor:
    """A PIL `image` as `model`'s pixels, by the transform named `transform`; its refusal (an image too large for
    it) names `what`."""
    try:
        return model.image_transform(transform)(image)
    except ImageError as e:
        raise ImageError(f"{what}: {e}") from None


def output_row(job: Job, event: Event, max_gen_len: int, max_seq_len: int) -> dict:
    row = {"id": job.id, "output": event.text, "finish_reason": event.finish_reason,
           "prompt_tokens": job.prompt_tokens, "output_tokens": event.completion_tokens,
           # the engine keeps a too-long prompt's last tokens (with a warning); say so where the answer is
           "prompt_truncated": job.prompt_tokens + max_gen_len > max_seq_len}
    return {**row, "error": event.error} if event.error else row


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


# ---- the whole job --------------------------------------------------------------------------------------------------

def run_batch(options: BatchOptions, sampling: dict, load_model: Callable) -> None:
    """Every rank: plan on global rank 0, load the model on each model-parallel group, generate each group's share,
    merge on global rank 0 and print the summary there. `load_model(mp_group)` returns a MetaModel."""
    layout = data_parallel_layout(options.mp)
    world = ParallelContext.from_group(None)
    leader = world.rank == 0
    plan = on_rank0(world, lambda: _prepare_and_mark_shared(options, sampling["max_gen_len"]))
    pending, nonce = world.broadcast_object((len(plan.pending), plan.check_nonce) if leader else None)
    try:
        _everyone_agrees(world, _shared_output_error(options, layout, nonce))
    finally:
        if leader:
            OutputFiles(options.output).shared_check.unlink()
    stats, encode_s = [GroupStats()], 0.0
    if pending:
        model = load_model(layout.mp_group)
        jobs, encode_s = on_rank0(world, lambda: _timed(_rendered, model, plan.pending, options,
                                                        sampling["max_gen_len"])) or (None, 0.0)
        mine = _scatter_to_groups(world, layout, split_jobs(jobs, layout.dp_size, sampling["max_gen_len"])
                                  if leader else None)
        if world.group is not None:
            dist.barrier()  # the groups start together: the generate latency is one wall-clock span
        mine_stats = run_group(model, layout, mine, options, sampling, leader)
        stats = _gather(world, mine_stats if model.ctx.is_source else None)
    if leader:
        files = OutputFiles(options.output)
        files.merge(plan.records, files.read_done({r.id for r in plan.records}))
        print(format_summary(options, layout, sampling, len(plan.records), len(plan.records) - pending,
                             [s for s in stats if s is not None], encode_s), flush=True)


def _rendered(model, records: list[Record], options: BatchOptions, max_gen_len: int) -> list[Job]:
    jobs = render_jobs(model.tokenizer, records, options.template, model.encode_prompt)
    check_room(jobs, max_gen_len, options.max_seq_len)
    return jobs


def _prepare_and_mark_shared(options: BatchOptions, max_gen_len: int) -> JobPlan:
    plan = prepare(options, max_gen_len)
    files = OutputFiles(options.output)
    files.shared_check.write_text(f"{plan.check_nonce} {socket.gethostname()}\n")
    return plan


def _shared_output_error(options: BatchOptions, layout: GroupLayout, nonce: str) -> Optional[BatchInputError]:
    """Each group's source must see the file global rank 0 just wrote beside --output: parts written on a disk
    only one machine sees would be missing from the merge."""
    if layout.mp_rank != 0:
        return None
    path = OutputFiles(options.output).shared_check
    try:
        seen = path.read_text().split()
    except OSError:
        seen = []
    if seen[:1] == [nonce]:
        return None
    return BatchInputError(f"data-parallel group {layout.dp_rank} (on {socket.gethostname()}) does not see {path}, "
                           f"which global rank 0 wrote: --output must be on a filesystem every machine shares")


def _timed(fn: Callable, *args):
    started = time.perf_counter()
    return fn(*args), time.perf_counter() - started


def on_rank0(world: ParallelContext, fn: Callable):
    """fn() on the group's rank 0 alone (None elsewhere); if it raises, every rank stops (see `_everyone_agrees`)."""
    result, error = None, None
    if world.rank == 0:
        try:
            result = fn()
        except Exception as e:  # every rank must hear of it, or the others would wait forever
            error = e
    _everyone_agrees(world, error)
    return result


def _everyone_agrees(world: ParallelContext, error: Optional[Exception]) -> None:
    """Collective over `world`'s group: if any rank failed, every rank stops. The failing rank raises its error (the CLI
    logs it and exits 2); the others exit 2 quietly, so the user reads one message, not one per rank."""
    if world.group is None:
        if error is not None:
            raise error
        return
    failed = [None] * world.world_size
    dist.all_gather_object(failed, None if error is None else str(error), group=world.group)
    if error is not None:
        raise error
    if any(failed):
        raise SystemExit(2)


def _scatter_to_groups(world: ParallelContext, layout: GroupLayout, per_group: Optional[list]) -> list[Job]:
    """Every rank gets its data-parallel group's jobs (the non-source ranks need them too: they decode alongside)."""
    if world.group is None:
        return per_group[0]
    box = [None]
    per_rank = [per_group[rank // layout.mp_size] for rank in range(world.world_size)] if per_group else None
    dist.scatter_object_list(box, per_rank, src=0)
    return box[0]


def _gather(world: ParallelContext, stats: Optional[GroupStats]) -> list:
    if world.group is None:
        return [stats]
    everyone = [None] * world.world_size if world.rank == 0 else None
    dist.gather_object(stats, everyone, dst=0)
    return everyone


def format_summary(options: BatchOptions, layout: GroupLayout, sampling: dict, records: int, skipped: int,
                   stats: list[GroupStats], encode_s: float) -> str:
    generated = sum(s.records for s in stats)
    tokens_in, tokens_out = sum(s.prompt_tokens for s in stats), sum(s.output_tokens for s in stats)
    generate_s = max(s.seconds for s in stats) if stats else 0.0  # the groups run side by side
    rate = tokens_out / generate_s if generate_s > 0 else 0.0
    return "\n".join([
        f"batch summary: {options.output}",
        f"  layout          {layout.dp_size} data-parallel x {layout.mp_size} model-parallel rank(s), "
        f"batch size {options.batch_size} per group, max_gen_len {sampling['max_gen_len']}",
        f"  records         {records} ({generated} generated, {skipped} already done)",
        f"  tokens          {tokens_in} input, {tokens_out} output",
        f"  encode latency  {encode_s:.3f} s (render and tokenize on rank 0)",
        f"  generate        {generate_s:.3f} s, {rate:.1f} output tokens/s",
    ])
