"""Write a model as N LLaMA2-Accessory shards + meta.json + config.json + tokenizer files, atomically.

Every rank's slice is cut with the same `Shard`s the loader reads with (a meta-device model at N ranks says what
each shard holds), so what is saved is exactly what loading expects. The folder is written under a temporary name
beside the destination and renamed into place at the end: a crash leaves no half-written checkpoint, and an
existing destination is never overwritten.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional, Sequence

import torch
from tqdm import tqdm

from accessory.checkpoint.formats import shard_name
from accessory.errors import CheckpointError
from accessory.model.LLM import model_classes
from accessory.parallel import ParallelContext, global_shape, shard_of


def save_checkpoint(dst: Path, state_dict: dict[str, torch.Tensor], config: dict, shards: int,
                    tokenizer_files: Sequence[Path] = (), llama_type: str = "llama",
                    dtype: Optional[torch.dtype] = None) -> Path:
    """Save full (unsharded) tensors, keyed by Meta names, as `shards` shard files in a new folder `dst`."""
    dst = Path(dst)
    model_args, transformer = model_classes(llama_type)
    args = model_args.from_dict(config, source="config to save")
    with atomic_folder(dst) as tmp:
        for rank in tqdm(range(shards), desc=f"writing {dst.name}", leave=False):
            with torch.device("meta"):
                model = transformer(args, ParallelContext(None, rank, shards, 0))
            shard = _cut_shard(model, state_dict, dtype)
            torch.save(shard, tmp / shard_name("accessory", rank, shards))
        (tmp / "meta.json").write_text(json.dumps({"llama_type": llama_type}, indent=2) + "\n")
        (tmp / "config.json").write_text(json.dumps(args.to_dict(), indent=2) + "\n")
        for path in tokenizer_files:
            shutil.copyfile(path, tmp / Path(path).name)
    return dst


@contextmanager
def atomic_folder(dst: Path) -> Iterator[Path]:
    """A temporary folder beside `dst` to write into; renamed to `dst` when the block ends, removed if it raises.

    `dst` must not exist: it is refused before anything is written, and if it appears meanwhile it is left alone.
    """
    dst = Path(dst)
    if dst.exists():
        raise CheckpointError(f"{dst} already exists; choose a new output folder (inputs are never overwritten)")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.partial-", dir=dst.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; the checkpoint should read like any new folder
    try:
        yield tmp
        try:
            os.rename(tmp, dst)
        except OSError as e:
            raise CheckpointError(f"{dst} appeared while it was being written; left it as it is") from e
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _cut_shard(model, state_dict: dict[str, torch.Tensor], dtype) -> dict[str, torch.Tensor]:
    # A parameter whose checkpoint key is another's (tied output) is not saved: it loads from that tensor.
    params = {name: p for name, p in model.named_parameters() if model.checkpoint_key(name) == name}
    missing, unexpected = sorted(params.keys() - state_dict.keys()), sorted(state_dict.keys() - params.keys())
    if missing or unexpected:
        raise CheckpointError(f"state dict to save does not match the model: missing {missing}, "
                              f"unexpected {unexpected}")
    out = {}
    for name, param in params.items():
        tensor, shard = state_dict[name], shard_of(model, name)
        expected = global_shape(param, shard)
        if list(tensor.shape) != expected:
            raise CheckpointError(f"tensor {name!r} has shape {list(tensor.shape)}, the config says {expected}")
        if shard is not None:
            tensor = tensor.narrow(shard.dim, shard.start, shard.stop - shard.start)
        # clone: torch.save of a view would write the whole underlying storage
        out["llma." + name] = tensor.to(dtype or tensor.dtype).clone().contiguous()
    return out
