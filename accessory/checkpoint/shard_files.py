"""Shard-file formats, found by file name, and reading a shard as lazily sliceable tensors.

| format                   | file names                                   | tensor names        |
|--------------------------|----------------------------------------------|---------------------|
| LLaMA2-Accessory         | consolidated.NN-of-MM.model.{pth,safetensors} | `llma.` + Meta's   |
| Meta's original release  | consolidated.NN.{pth,safetensors} (+ params.json) | Meta's          |
| delta against a base     | consolidated.NN-of-MM.model-diff.{pth,safetensors} | `llma.` + Meta's |

A delta folder (LLaMA2-Accessory's `model-diff`, written by `accessory weights extract`) holds fine-tuned minus base:
loaded after its base (`pretrained_path=[base, delta]`) its tensors ADD to the values loaded so far; a tensor the
base lacks (LoRA, biases) is a delta against zero, that is, the value itself.

A `.pth` file is read with `torch.load(weights_only=True, mmap=True)`: it is data, never code, and each rank reads
only the pages of the slices it copies. A `.safetensors` file is sliced through `safe_open`.
"""
from __future__ import annotations

import pickle
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from accessory.errors import CheckpointError

SHARD_PATTERNS = {
    "accessory": re.compile(r"^consolidated\.(\d+)-of-(\d+)\.model\.(pth|safetensors)$"),
    "accessory-delta": re.compile(r"^consolidated\.(\d+)-of-(\d+)\.model-diff\.(pth|safetensors)$"),
    "meta": re.compile(r"^consolidated\.(\d+)\.(pth|safetensors)$"),
}
PREFIX = {"accessory": "llma.", "accessory-delta": "llma.", "meta": ""}
ADDITIVE = frozenset({"accessory-delta"})  # formats whose tensors add to the earlier folders' instead of replacing
# Tensors some formats carry that the runtime recomputes: Meta's LLaMA-1/2 shards hold the RoPE table.
IGNORED_KEYS = frozenset({"rope.freqs"})


@dataclass(frozen=True)
class ShardSet:
    folder: Path
    kind: str  # a key of SHARD_PATTERNS
    files: tuple[Path, ...]  # in shard order


def find_shards(folder: Path) -> ShardSet:
    """The folder's shard files, checked to form one complete set of one format and one count."""
    if not folder.is_dir():
        raise CheckpointError(f"checkpoint folder {folder} does not exist or is not a folder")
    found = {kind: [] for kind in SHARD_PATTERNS}
    for path in sorted(folder.iterdir()):
        for kind, pattern in SHARD_PATTERNS.items():
            if match := pattern.match(path.name):
                found[kind].append((path, match.groups()))
    kinds = [kind for kind, files in found.items() if files]
    if not kinds:
        raise CheckpointError(
            f"{folder}: no checkpoint shards found; expected consolidated.NN-of-MM.model.pth (LLaMA2-Accessory), "
            f"consolidated.NN.pth (Meta), consolidated.NN-of-MM.model-diff.pth (a delta), or the same names "
            f"ending .safetensors")
    if len(kinds) > 1:
        names = sorted(p.name for kind in kinds for p, _ in found[kind])
        raise CheckpointError(f"{folder}: shards of two formats in one folder ({names}); keep one set")
    kind = kinds[0]
    entries = found[kind]
    extensions = {groups[-1] for _, groups in entries}
    if len(extensions) > 1:
        raise CheckpointError(f"{folder}: both .pth and .safetensors shards ({sorted(p.name for p, _ in entries)}); "
                              f"keep one set")
    if kind != "meta":  # the names carry the count
        counts = sorted({int(groups[1]) for _, groups in entries})
        if len(counts) > 1:
            raise CheckpointError(f"{folder}: shards of different counts {counts} in one folder "
                                  f"({sorted(p.name for p, _ in entries)}); remove the stale set")
        count = counts[0]
    else:
        count = max(int(groups[0]) for _, groups in entries) + 1
    by_index = {int(groups[0]): path for path, groups in entries}
    ext = extensions.pop()
    missing = [shard_name(kind, i, count, ext) for i in range(count) if i not in by_index]
    if missing or len(by_index) != count:
        raise CheckpointError(f"{folder}: incomplete checkpoint: missing shard file(s) {missing} "
                              f"of {count}")
    return ShardSet(folder, kind, tuple(by_index[i] for i in range(count)))


def shard_name(kind: str, index: int, count: int, ext: str = "pth") -> str:
    if kind == "meta":
        return f"consolidated.{index:02d}.{ext}"
    infix = "model-diff" if kind == "accessory-delta" else "model"
    return f"consolidated.{index:02d}-of-{count:02d}.{infix}.{ext}"


class Piece:
    """One shard's copy of one tensor: its shape and dtype, and `read(index)` to fetch a slice of it."""

    def __init__(self, shape, read, dtype: torch.dtype):
        self.shape, self.read, self.dtype = tuple(shape), read, dtype


def read_shard(path: Path, kind: str) -> dict[str, Piece]:
    """Tensors of one shard file, by Meta name (format prefix removed)."""
    tensors = _read_safetensors(path) if path.suffix == ".safetensors" else _read_pth(path)
    prefix = PREFIX[kind]
    pieces = {}
    for key, piece in tensors.items():
        if not key.startswith(prefix):
            raise CheckpointError(f"{path}: tensor {key!r} lacks the {prefix!r} prefix of the {kind} format")
        pieces[key[len(prefix):]] = piece
    return pieces


def _read_pth(path: Path) -> dict[str, Piece]:
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as e:
        raise CheckpointError(
            f"{path}: refusing to load: the file holds pickled objects other than tensors, and unpickling them "
            f"could run code. Re-save it as a plain state dict of tensors. (torch: {str(e).splitlines()[0]})") from e
    except (RuntimeError, OSError, EOFError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot be read as a PyTorch checkpoint; the file is truncated or corrupt "
                              f"({str(e).splitlines()[0]})") from e
    if isinstance(obj, dict) and set(obj) == {"model"} and isinstance(obj["model"], dict):
        obj = obj["model"]  # LLaMA2-Accessory's {"model": state_dict} wrapper
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise CheckpointError(f"{path}: expected a dict of tensor name -> tensor, found {type(obj).__name__}")
    return {key: Piece(t.shape, t.__getitem__, t.dtype) for key, t in obj.items()}


def _read_safetensors(path: Path) -> dict[str, Piece]:
    from safetensors import SafetensorError, safe_open

    try:
        handle = safe_open(str(path), framework="pt", device="cpu")
        slices = {key: handle.get_slice(key) for key in handle.keys()}
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot be read as safetensors; the file is truncated or corrupt ({e})") from e
    return {key: Piece(s.get_shape(), s.__getitem__, _SAFETENSORS_DTYPES.get(s.get_dtype()))
            for key, s in slices.items()}


# safetensors' dtype names (the ones a checkpoint holds); an unlisted one reads as None (kept as read)
_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                       "U8": torch.uint8, "BOOL": torch.bool}

