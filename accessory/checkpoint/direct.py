"""A checkpoint path that is a llama.cpp `.gguf` file or a Hugging Face folder loads directly: it is imported once
into the cache (`$ACCESSORY_CACHE/imported/`, keyed by the source's identity: its path, size and modification
time), then loaded from there as any checkpoint folder. What llama.cpp and vLLM users type works:
`--pretrained_path model.gguf`, `MetaModel.from_pretrained("/hf/Qwen2.5-0.5B-Instruct")`.

A GGUF keeps its quantized bits (the types accessory keeps: Q8_0, Q4_0, Q4_1, Q5_0, Q4_K, Q5_K, Q6_K; others are
dequantized), as llama.cpp runs the file; `accessory convert gguf` without `--keep-quantized` makes a float import.
An HF folder is imported in its stored dtype. Processes on one machine import once: the first takes a file lock,
the others wait for it and find the import done; the import itself is atomic, so a killed one leaves nothing.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import logging
from pathlib import Path

from accessory.cache_dir import cache_folder

log = logging.getLogger(__name__)


def source_kind(path: Path) -> str | None:
    """"gguf" for a GGUF file, "hf" for an HF model folder (config.json naming architectures or a model_type, and
    HF weights, no accessory shards), None for anything else (an accessory or Meta checkpoint folder)."""
    if path.is_file() and path.suffix == ".gguf":
        return "gguf"
    config = path / "config.json"
    if not path.is_dir() or not config.is_file() or any(path.glob("consolidated.*")):
        return None
    weights = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
    if not any((path / name).is_file() for name in weights):
        return None
    try:
        hf = json.loads(config.read_text())
    except (OSError, ValueError):
        return None
    return "hf" if isinstance(hf, dict) and ("architectures" in hf or "model_type" in hf) else None


def imported(path: Path) -> Path:
    """`path` itself if it is a checkpoint folder; else its import in the cache, made first if needed."""
    kind = source_kind(path)
    if kind is None:
        return path
    target = cache_folder("imported") / f"{path.stem if kind == 'gguf' else path.name}-{kind}-{_identity(path)}"
    if target.is_dir():
        log.info("%s: loading its import %s", path, target)
        return target
    with open(target.parent / f"{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process on this machine may be importing it: wait for it
        if not target.is_dir():
            from accessory.checkpoint.convert import convert

            log.info("%s: importing it once into %s (later loads read the import)", path, target)
            convert(kind, path, target, 1, keep_quantized=kind == "gguf")
    return target


def _identity(path: Path) -> str:
    """A short hash of what the source is: its resolved path, size and modification time (a folder's: of every
    file in it), so a changed source is imported again."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    stats = [(str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    return hashlib.sha256(repr(stats).encode()).hexdigest()[:16]
