"""`torch.distributed.checkpoint` folders (a `.metadata` file + `*.distcp` data files) -> canonical form.

Such a folder holds a state dict saved by `torch.distributed.checkpoint.save`, here one keyed by Meta names,
possibly under a `llma.` (LLaMA2-Accessory's MetaModel) or `model.` prefix. It carries no config or tokenizer:
those come from files beside it or from flags. It is read in this one process, with no process group: the
metadata tells every tensor's shape and dtype, so the tensors are allocated whole and `dcp.load` fills them.
"""
from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Optional, Sequence

import torch
from tqdm import tqdm

from accessory.checkpoint.config import read_spec, resolved_config
from accessory.checkpoint.shard_files import IGNORED_KEYS
from accessory.checkpoint.importers.common import ImportedModel, bracketed
from accessory.checkpoint.importers.shards import model_layout
from accessory.checkpoint.load import key_mismatch
from accessory.errors import CheckpointError
from accessory.text.tokenizer import find_tokenizer_for

log = logging.getLogger(__name__)
PREFIXES = ("llma.", "model.", "")


def read_dcp_metadata(folder: Path):
    """The folder's `torch.distributed.checkpoint` Metadata; CheckpointError naming the folder if unreadable."""
    from torch.distributed.checkpoint import FileSystemReader

    if not (folder / ".metadata").is_file():
        raise CheckpointError(f"{folder}: not a torch.distributed.checkpoint folder (no .metadata file)")
    try:
        return FileSystemReader(str(folder)).read_metadata()
    except Exception as e:  # pickle, EOF and OS errors all mean the same thing here
        raise CheckpointError(f"{folder / '.metadata'}: cannot be read ({type(e).__name__}: {e})") from e


def tensor_entries(metadata) -> dict:
    """Key -> TensorStorageMetadata (size, properties.dtype) of the tensors in the metadata."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    return {k: m for k, m in metadata.state_dict_metadata.items() if isinstance(m, TensorStorageMetadata)}


def model_prefix(keys, folder: Path) -> str:
    """The prefix the model's tensors are saved under: the one in front of `tok_embeddings.weight`."""
    for prefix in PREFIXES:
        if prefix + "tok_embeddings.weight" in keys:
            return prefix
    raise CheckpointError(f"{folder}: no tok_embeddings.weight under any of the prefixes {list(PREFIXES)}; "
                          f"holds {bracketed(sorted(keys))}")


def _load_tensor(folder: Path, key: str, meta) -> torch.Tensor:
    """One tensor, allocated from its metadata and filled by `dcp.load` in this process alone (one call per tensor,
    so that a progress bar can follow; each reads only that tensor's bytes)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    from torch.distributed.checkpoint.api import CheckpointException

    wanted = {key: torch.empty(tuple(meta.size), dtype=meta.properties.dtype)}
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(wanted, storage_reader=FileSystemReader(str(folder)), no_dist=True)
    except CheckpointException as e:  # a BaseException wrapping each rank's failure (a missing or short file)
        causes = "; ".join(f"{type(exc).__name__}: {str(exc).splitlines()[0]}" for exc, _ in e.failures.values())
        raise CheckpointError(f"{folder}: reading tensor {key!r} failed ({causes})") from None
    except Exception as e:
        raise CheckpointError(f"{folder}: reading tensor {key!r} failed ({type(e).__name__}: {e})") from e
    return wanted[key]


def read_dcp(folder, llama_type: Optional[str] = None, llama_config: Sequence[str] = (),
             tokenizer_path=None) -> ImportedModel:
    """The model tensors of a DCP folder under canonical names; the config from meta.json / params.json /
    config.json beside them and then `llama_config`; the tokenizer found there or at `tokenizer_path`.
    Entries outside the model's prefix (an optimizer's state, say) are skipped, and listed in the log."""
    folder = Path(folder)
    entries = tensor_entries(read_dcp_metadata(folder))
    spec = read_spec([folder], llama_type, llama_config)
    tokenizer = find_tokenizer_for([folder], tokenizer_path)
    config = resolved_config(spec.config, tokenizer, str(folder))
    shapes = model_layout(spec.llama_type, config, f"config of {folder}")
    prefix = model_prefix(entries.keys(), folder)
    ours = {k[len(prefix):]: m for k, m in entries.items() if k.startswith(prefix)}
    if skipped := sorted(k for k in entries if not k.startswith(prefix)):
        log.info("%s: skipping %d entries outside the model's %r prefix: %s", folder, len(skipped), prefix,
                 bracketed(skipped))
    problem = key_mismatch(ours.keys(), shapes.keys())
    wrong = [f"{k}: {tuple(m.size)}, expected {shapes[k]}" for k, m in ours.items()
             if k in shapes and tuple(m.size) != shapes[k]]
    if problem or wrong:
        raise CheckpointError(f"{folder}: {problem or 'tensor shape(s) disagree with the config: ' + bracketed(wrong)}")
    state_dict = {k: _load_tensor(folder, prefix + k, m) for k, m in
                  tqdm(ours.items(), desc=f"reading {folder.name}", unit="tensor") if k not in IGNORED_KEYS}
    return ImportedModel(state_dict, config, tokenizer.files if tokenizer else [], spec.llama_type)
