"""Write a model as N LLaMA2-Accessory shards + meta.json + config.json + tokenizer files, atomically.

Every rank's slice is cut with the same `Shard`s the loader reads with (a meta-device model at N ranks says what
each shard holds), so what is saved is exactly what loading expects. The folder is written under a temporary name
beside the destination and renamed into place at the end: a crash leaves no half-written checkpoint, and an
existing destination is never overwritten.

A quantized checkpoint is written as safetensors shards (consolidated.NN-of-MM.model.safetensors), each quantized
weight as its parts (NAME.q, NAME.scale, NAME.min: quant/formats.py), with meta.json saying which weights are
quantized and how (checkpoint/config.py `Quantization`).
"""
from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import socket
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Mapping, Optional, Sequence

import torch
from tqdm import tqdm

from accessory.checkpoint.config import Quantization
from accessory.checkpoint.shard_files import shard_name
from accessory.errors import CheckpointError
from accessory.network.LLM import model_classes
from accessory.parallel import ParallelContext, global_shape, shard_of
from accessory.parallel.quantized_weight import QuantizedWeight

log = logging.getLogger(__name__)


def save_checkpoint(dst: Path, state_dict: Mapping[str, torch.Tensor], config: dict, shards: int,
                    tokenizer_files: Sequence[Path] = (), llama_type: str = "llama",
                    dtype: Optional[torch.dtype] = None, quantization: Optional[dict[str, str]] = None) -> Path:
    """Save full (unsharded) tensors, keyed by Meta names, as `shards` shard files in a new folder `dst`.
    `quantization`: weight name -> format of the weights given as quantized parts (`dtype` leaves those alone)."""
    dst = Path(dst)
    model_args, transformer = model_classes(llama_type)
    args = model_args.from_dict(config, source="config to save")
    record = Quantization.describe(quantization) if quantization else None
    meta = {"llama_type": llama_type, **({"quantization": record.to_json()} if record else {})}
    with atomic_folder(dst) as tmp:
        for rank in range(shards):
            model = meta_model(transformer, args, rank, shards, quantization)
            label = f"writing {dst.name}: shard {rank + 1} of {shards}"
            write_shard(_cut_shard(model, state_dict, dtype, label), tmp, "accessory", rank, shards,
                        safetensors=bool(record))
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
        (tmp / "config.json").write_text(json.dumps(args.to_dict(), indent=2) + "\n")
        for path in tokenizer_files:
            shutil.copyfile(path, tmp / Path(path).name)
    return dst


def check_new_folder(dst) -> Path:
    """`dst` as a Path, if it can be made as a new output folder: it must not exist (inputs are never overwritten),
    and whatever of its parents exists must be a folder. Checked before any slow work; CheckpointError otherwise."""
    dst = Path(dst)
    if dst.exists() or dst.is_symlink():
        raise CheckpointError(f"{dst} already exists; choose a new output folder (inputs are never overwritten)")
    parent = next((p for p in dst.parents if p.exists()), None)
    if parent is not None and not parent.is_dir():
        raise CheckpointError(f"{dst}: cannot make a folder there, {parent} is a file; choose a new output folder")
    return dst


@contextmanager
def atomic_folder(dst: Path) -> Iterator[Path]:
    """A temporary folder beside `dst` to write into; renamed to `dst` when the block ends, removed if it raises.

    `dst` must not exist: it is refused before anything is written, and if it appears meanwhile it is left alone.
    A temporary folder that a killed run left for the same `dst` is removed first (logged). A full disk is a
    CheckpointError naming `dst` and the space (write_shard checks before each shard)."""
    dst = check_new_folder(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    _remove_abandoned(dst)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}{PARTIAL}", dir=dst.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; the checkpoint should read like any new folder
    (tmp / WRITER).write_text(f"{socket.gethostname()} {os.getpid()}\n")
    try:
        yield tmp
        (tmp / WRITER).unlink()
        try:
            os.rename(tmp, dst)
        except OSError as e:
            raise CheckpointError(f"{dst} appeared while it was being written; left it as it is") from e
    except BaseException as e:
        full = _disk_full(e, dst.parent)
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, NoSpace):
            raise NoSpace(f"writing {dst}: {e}") from None
        if full:
            raise CheckpointError(f"writing {dst}: the disk is full ({_size(shutil.disk_usage(dst.parent).free)} free "
                                  f"once the partial output was removed): {type(e).__name__}: {e}") from e
        raise


class NoSpace(CheckpointError):
    """The disk cannot hold what is being written."""


PARTIAL = ".partial-"  # a folder being written is .DST.partial-XXXX beside DST
WRITER = ".accessory-writer"  # in it: the host and pid writing it


def _remove_abandoned(dst: Path) -> None:
    """Remove the temporary folders of earlier runs for `dst` whose writer (on this machine) is gone."""
    for folder in dst.parent.glob(f".{dst.name}{PARTIAL}*"):
        try:
            host, pid = (folder / WRITER).read_text().split()
        except (OSError, ValueError):
            continue  # not ours to judge: no writer recorded
        if host == socket.gethostname() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(folder, ignore_errors=True)
            log.warning("removed %s, left by an interrupted run (pid %s)", folder, pid)


def _disk_full(error: BaseException, folder: Path) -> bool:
    if isinstance(error, OSError) and error.errno == errno.ENOSPC:
        return True
    try:  # torch.save reports a short write as a RuntimeError ("unexpected pos ...")
        return isinstance(error, (OSError, RuntimeError)) and shutil.disk_usage(folder).free < (1 << 20)
    except OSError:
        return False


def _size(n: int) -> str:
    return f"{n / 2 ** 20:.1f} MiB ({n} bytes)"


def meta_model(transformer, args, rank: int, shards: int, quantization: Optional[dict[str, str]] = None):
    """The model as rank `rank` of `shards` holds it, on the meta device: what one shard file holds."""
    with torch.device("meta"):
        model = transformer(args, ParallelContext(None, rank, shards, 0))
    if quantization:
        model.quantize_(quantization)
    return model


def write_shard(tensors: dict[str, torch.Tensor], folder: Path, kind: str, rank: int, shards: int,
                safetensors: bool) -> None:
    """Write one shard file into `folder`, first checking that the disk has room for it."""
    need = sum(t.numel() * t.element_size() for t in tensors.values())
    free = shutil.disk_usage(folder).free
    if need > free:
        raise NoSpace(f"not enough disk space: shard {rank + 1} of {shards} needs {_size(need)}, the disk has "
                              f"{_size(free)} free (the remaining shards need about {_size(need * (shards - rank))})")
    if safetensors:
        from safetensors.torch import save_file

        save_file(tensors, str(folder / shard_name(kind, rank, shards, "safetensors")), metadata={"format": "pt"})
    else:
        torch.save(tensors, folder / shard_name(kind, rank, shards))


def is_quantized_part(model, name: str) -> bool:
    owner = name.rpartition(".")[0]
    return bool(owner) and isinstance(model.get_submodule(owner), QuantizedWeight)


def _cut_shard(model, state_dict: Mapping[str, torch.Tensor], dtype, label: str) -> dict[str, torch.Tensor]:
    """This shard's tensors, each read from `state_dict` once (LazyTensors make each as it is read)."""
    # A tensor whose checkpoint key is another's (tied output) is not saved: it loads from that tensor.
    params = model.saved_tensors()  # this shard's: another shard's experts are left out
    missing = sorted(params.keys() - state_dict.keys())
    unexpected = sorted(state_dict.keys() - params.keys() - model.held_elsewhere())
    if missing or unexpected:
        raise CheckpointError(f"state dict to save does not match the model: missing {missing}, "
                              f"unexpected {unexpected}")
    out = {}
    for name, param in tqdm(params.items(), desc=label, unit="tensor", leave=False):
        tensor, shard = state_dict[name], shard_of(model, name)
        expected = global_shape(param, shard)
        if list(tensor.shape) != expected:
            raise CheckpointError(f"tensor {name!r} has shape {list(tensor.shape)}, the config says {expected}")
        if shard is not None:
            tensor = tensor.narrow(shard.dim, shard.start, shard.stop - shard.start)
        if dtype is not None and not is_quantized_part(model, name):
            tensor = tensor.to(dtype)
        out["llma." + name] = _whole(tensor)
    return out


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` (detached) if it is all of its storage, else a copy: torch.save writes a view's whole storage (the
    full tensor of a shard's slice, or a memory-mapped file). A tensor made for the save (dequantized, cast) is not
    copied again, so the peak stays at the output plus one tensor."""
    if tensor.is_contiguous() and tensor.storage_offset() == 0 and \
            tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size():
        return tensor.detach()
    return tensor.clone(memory_format=torch.contiguous_format)
