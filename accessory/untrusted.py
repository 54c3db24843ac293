"""The checks every value read from a file or flag a user can point at goes through before it is trusted: JSON
objects of bounded nesting, strictly decoded text, numbers of the expected type, finite and in range, and paths
inside their folder. A failure raises the calling layer's error type (ConfigError, CheckpointError, ...) with a
message naming the file or flag, the key and the value, and what was expected; callers never see a RecursionError,
a UnicodeDecodeError or a ZeroDivisionError from a hostile input.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional

MAX_DEPTH = 64  # JSON nesting: real configs nest 3-5 deep; far deeper ones are refused before they are walked
MAX_JSON_BYTES = 64 << 20  # a config, index or adapter config larger than this is not one


def read_json_object(path: Path, error: type[Exception], max_bytes: int = MAX_JSON_BYTES) -> dict:
    """The JSON object in `path`; `error` naming the file if it is unreadable, too large, not UTF-8, not JSON, nested
    deeper than MAX_DEPTH, or not an object."""
    path = Path(path)
    try:
        size = path.stat().st_size
        if size > max_bytes:
            raise error(f"{path}: {size} bytes; a JSON file of at most {max_bytes} bytes was expected")
        text = path.read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise error(f"{path}: cannot be read as JSON ({e})") from e
    return json_object(text, str(path), error)


def json_object(text: str, where: str, error: type[Exception]) -> dict:
    """The JSON object `text` (from `where`: a file, a flag); `error` naming `where` if it is not JSON, nested deeper
    than MAX_DEPTH, or not an object."""
    value = json_value(text, where, error)
    if not isinstance(value, dict):
        raise error(f"{where}: expected a JSON object, found {type(value).__name__}")
    return value


def json_value(text: str, where: str, error: type[Exception]):
    """Any JSON value `text`, nested at most MAX_DEPTH deep (checked before parsing, so a deep one costs no
    recursion); `error` naming `where` otherwise."""
    depth = nesting(text)
    if depth > MAX_DEPTH:
        raise error(f"{where}: JSON nested {depth} deep; at most {MAX_DEPTH} levels were expected")
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError, ValueError) as e:
        raise error(f"{where}: cannot be read as JSON ({e})") from e


def nesting(text: str) -> int:
    """How deep JSON `text`'s arrays and objects nest (brackets inside strings not counted): a linear scan."""
    depth = deepest = 0
    in_string = escaped = False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    return deepest


def decoded(data: bytes, where: str, error: type[Exception]) -> str:
    """`data` as UTF-8, strictly; `error` naming `where` otherwise."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{where}: not UTF-8 text ({e})") from None


def integer(value, where: str, key: str, error: type[Exception], low: int = 1, high: Optional[int] = None) -> int:
    """`value` as an int in [low, high] (a float with an integral value counts; bool does not)."""
    number = value
    if isinstance(value, float) and math.isfinite(value) and value == int(value):
        number = int(value)
    if (not isinstance(number, int) or isinstance(number, bool) or number < low
            or (high is not None and number > high)):
        span = f"[{low}, {high}]" if high is not None else f">= {low}"
        raise error(f"{where}: {key} must be an integer {span}, got {shown(value)}")
    return number


def number(value, where: str, key: str, error: type[Exception], low: float = -math.inf, high: float = math.inf,
           above: Optional[float] = None) -> float:
    """`value` as a finite float in [low, high] (and > `above`, if given)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    try:
        as_float = float(value) if ok else math.nan
    except OverflowError:  # an int of hundreds of digits
        as_float = math.inf
    if not math.isfinite(as_float) or not low <= as_float <= high or (above is not None and as_float <= above):
        bounds = [f">= {low}" if low > -math.inf else "", f"<= {high}" if high < math.inf else "",
                  f"> {above}" if above is not None else ""]
        span = " and ".join(b for b in bounds if b)
        raise error(f"{where}: {key} must be a finite number{' ' + span if span else ''}, got {shown(value)}")
    return as_float


def inside(folder: Path, name, where: str, error: type[Exception]) -> Path:
    """folder / name, resolved, if it stays inside `folder` (no absolute path, no `..` out of it, no link out of
    it); `error` naming `where` and the name otherwise."""
    if not isinstance(name, str) or not name or "\x00" in name:
        raise error(f"{where}: expected a file name inside {folder}, got {shown(name)}")
    root = Path(folder).resolve()
    path = (root / name).resolve()
    if path != root and root not in path.parents:
        raise error(f"{where}: {shown(name)} is outside {folder}; only files inside the folder are read")
    return path


def shown(value, limit: int = 80) -> str:
    """`value`'s repr for a message, cut to `limit` characters (a hostile value may be megabytes long)."""
    if isinstance(value, int) and value.bit_length() > 200:  # repr of a 5000-digit int raises in Python 3.11
        return f"an integer of about {int(value.bit_length() * math.log10(2)) + 1} digits"
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def named_inside(folder: Path, name, where: str, error: type[Exception]) -> Path:
    """folder / name if `name` is a relative path whose parts stay inside `folder` (no absolute path, no `..`);
    `error` naming `where` and the name otherwise. Unlike `inside`, links are not resolved: a link the folder itself
    holds may point elsewhere, as the Hugging Face cache links each snapshot's files to its blobs folder."""
    if not isinstance(name, str) or not name or "\x00" in name:
        raise error(f"{where}: expected a file name inside {folder}, got {shown(name)}")
    if Path(name).is_absolute() or ".." in Path(name).parts:
        raise error(f"{where}: {shown(name)} is outside {folder}; only files inside the folder are read")
    return Path(folder) / name
