"""A checkpoint path that is a llama.cpp `.gguf` file or a Hugging Face folder loads directly: it is imported once
into the cache (`$ACCESSORY_CACHE/imported/`, keyed by the source's identity: its path, size, modification time and
a hash of the parts of its content that describe it, `_identity`), then loaded from there as any checkpoint folder.
What llama.cpp and vLLM users type works: `--pretrained_path model.gguf`,
`MetaModel.from_pretrained("/hf/Qwen2.5-0.5B-Instruct")`.

A GGUF keeps its quantized bits (the types accessory keeps: Q8_0, Q4_0, Q4_1, Q5_0, Q4_K, Q5_K, Q6_K; others are
dequantized), as llama.cpp runs the file; `accessory convert gguf` without `--keep-quantized` makes a float import.
An HF folder is imported in its stored dtype. Processes on one machine import once: the first takes a file lock,
the others wait for it and find the import done; the import itself is atomic, so a killed one leaves nothing.
"""
from __future__ import annotations

import fcntl
import hashlib
import logging
from pathlib import Path

from accessory.cache_dir import cache_folder
from accessory.errors import ConfigError
from accessory.untrusted import read_json_object

log = logging.getLogger(__name__)


HF_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


def source_kind(path: Path) -> str | None:
    """"gguf" for a GGUF file, "hf" for an HF model folder (config.json naming architectures or a model_type, and
    HF weights, no accessory shards), None for anything else (an accessory or Meta checkpoint folder). A folder of
    HF weights whose config.json is not a JSON object (unreadable, too large, nested too deep) is an HF folder that
    cannot be loaded: ConfigError naming the file, rather than a guess that it is some other kind."""
    if path.is_file() and path.suffix == ".gguf":
        return "gguf"
    config = path / "config.json"
    if not path.is_dir() or not config.is_file() or any(path.glob("consolidated.*")):
        return None
    if not any((path / name).is_file() for name in HF_WEIGHTS):
        return None
    hf = read_json_object(config, ConfigError)
    return "hf" if "architectures" in hf or "model_type" in hf else None


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


HEAD_BYTES = 16 << 20  # a GGUF's header, metadata (its tokenizer too) and tensor index sit in its first bytes
TAIL_BYTES = 1 << 20
MAX_SAFETENSORS_HEADER = 100 << 20  # the safetensors package's own limit; a longer one is hashed only this far


def _identity(path: Path) -> str:
    """A short hash of what the source is, so a changed source is imported again: for each file (a folder's: every
    file in it), its resolved path, size and modification time, and a hash of its content's first 16 MiB (a
    safetensors file's: its whole header instead) and last 1 MiB. Small files (config.json, the tokenizer) are
    hashed whole. Not caught: a change inside the tensor data between those ends that keeps the file's size and
    modification time (a file rewritten in place with its mtime restored)."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    digest = hashlib.sha256()
    for file in files:
        stat = file.stat()
        digest.update(repr((str(file.resolve()), stat.st_size, stat.st_mtime_ns)).encode())
        digest.update(_content_digest(file, stat.st_size))
    return digest.hexdigest()[:16]


def _content_digest(file: Path, size: int) -> bytes:
    """sha256 of the file's head (its first HEAD_BYTES; a safetensors file's header) and its last TAIL_BYTES."""
    digest = hashlib.sha256()
    with open(file, "rb") as f:
        head = HEAD_BYTES
        if file.suffix == ".safetensors":  # 8 bytes of header length, then the header (bounded: it may be hostile)
            head = min(8 + int.from_bytes(f.read(8), "little"), size, 8 + MAX_SAFETENSORS_HEADER)
            f.seek(0)
        digest.update(f.read(head))
        f.seek(max(head, size - TAIL_BYTES))
        digest.update(f.read(TAIL_BYTES))
    return digest.digest()
