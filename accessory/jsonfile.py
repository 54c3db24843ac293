"""Reading a JSON-object file, with the error type of the layer that asks (config, checkpoint, tokenizer)."""
from __future__ import annotations

import json
from pathlib import Path


def read_json_object(path: Path, error: type[Exception]) -> dict:
    """The JSON object in `path`; `error` naming the file if it is unreadable, not JSON, or not an object."""
    try:
        value = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise error(f"{path}: cannot be read as JSON ({e})") from e
    if not isinstance(value, dict):
        raise error(f"{path}: expected a JSON object, found {type(value).__name__}")
    return value
