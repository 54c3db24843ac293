"""The output of `accessory batch`, resumable after any crash. Files, for `--output OUT`:

    OUT.part-G   the records data-parallel group G has finished, one JSON line each, appended and flushed the
                 moment a record ends. Only group G's source rank writes it, so groups never interleave lines.
    OUT          the final output, written by global rank 0 when every record is done: one line per input record,
                 in input order, through OUT.merging and a rename (readers never see half of it); the parts are
                 removed after the rename.
    OUT.shared-check   written by global rank 0 and read by each group's source before any model loads, so that
                 an OUT on a disk some machine cannot see is refused at once; removed right after.

A rerun reads OUT and every OUT.part-* to learn which ids are done and generates only the others. A last line
without its newline (a process killed mid-write) is dropped and regenerated; any other line that is not a record
of this input is an error.
"""
from __future__ import annotations

import json
import logging
import os
import socket
from pathlib import Path
from typing import Optional

from accessory.batch.errors import BatchInputError
from accessory.batch.rendering import Job
from accessory.batch.records import Record, is_record_id
from accessory.generation.requests import Event, fits_window

log = logging.getLogger(__name__)


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

    def mark_shared_check(self, nonce: str) -> None:
        """Global rank 0 writes the file every group's source must then see (`shared_check_error`)."""
        self.shared_check.write_text(f"{nonce} {socket.gethostname()}\n")

    def shared_check_error(self, nonce: str, group: int) -> Optional[BatchInputError]:
        """None if this machine sees the file global rank 0 just wrote beside --output; else the error: parts
        written on a disk only one machine sees would be missing from the merge."""
        path = self.shared_check
        try:
            seen = path.read_text().split()
        except OSError:
            seen = []
        if seen[:1] == [nonce]:
            return None
        return BatchInputError(f"data-parallel group {group} (on {socket.gethostname()}) does not see {path}, "
                               f"which global rank 0 wrote: --output must be on a filesystem every machine shares")

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
    if not isinstance(row, dict) or not is_record_id(row.get("id")) or not isinstance(row.get("output"), str):
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


def output_row(job: Job, event: Event, max_gen_len: int, max_seq_len: int) -> dict:
    """A finished job's line of the output: its answer, how it ended, its token counts, and any error."""
    row = {"id": job.id, "output": event.text, "finish_reason": event.finish_reason,
           "prompt_tokens": job.prompt_tokens, "output_tokens": event.completion_tokens,
           # the engine keeps a too-long prompt's last tokens (with a warning); say so where the answer is
           "prompt_truncated": not fits_window(job.prompt_tokens, max_gen_len, max_seq_len)}
    return {**row, "error": event.error} if event.error else row
