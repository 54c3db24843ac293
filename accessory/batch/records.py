"""The input of `accessory batch`: every record of the JSONL file, each line checked (a bad one named with its line
and what was expected), and each record's image file read whole before any model loads. The input file is only
ever read."""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

from accessory.batch.errors import BatchInputError
from accessory.data.images import ImageError, read_image_file

RecordId = Union[str, int]
RECORD_KEYS = ("id", "prompt", "messages", "image")
EXPECTED = ('one JSON object per line, {"id": string or integer, "prompt": string} or '
            '{"id": ..., "messages": [{"role": "system"|"user"|"assistant", "content": string}, ...]}, '
            'each with an optional "image": "path/to/file"')
JSON_TYPES = {dict: "object", list: "array", str: "string", int: "number", float: "number", bool: "boolean",
              type(None): "null"}


@dataclass(frozen=True)
class Record:
    line: int  # 1-based line number in the input
    id: RecordId
    prompt: Optional[str] = None
    messages: Optional[list] = None
    image: Optional[Path] = None  # an image file, relative paths already resolved against the input's folder


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
    if not is_record_id(record_id):
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


def is_record_id(value) -> bool:
    """A string or an integer: what an input record's id, and so an output row's, may be."""
    return isinstance(value, (str, int)) and not isinstance(value, bool)  # True == 1 would collide with id 1


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
