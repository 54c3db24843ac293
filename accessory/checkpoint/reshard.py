"""Rewrite checkpoint folders on disk one output shard at a time: `reshard` (any N -> M), and the engine under
delta.py's apply and extract.

Each output shard is cut with the `Shard`s of a meta-device model at the output's size, as save.py cuts, and each
of its tensors is read from the input folders with load.py's slicing (`copy_sum`), so only that shard and the
input pages it needs are in memory. The inputs are reopened for every output shard, so the pages mapped for one
shard are let go before the next. The output folder is written atomically (save.atomic_folder).
"""
from __future__ import annotations

import logging
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch
from tqdm import tqdm

from accessory.checkpoint.config import CONFIG_FILES, read_spec, resolved_config
from accessory.checkpoint.shard_files import ADDITIVE, IGNORED_KEYS, find_shards
from accessory.checkpoint.load import Term, copy_sum, open_checkpoint, piece_layout
from accessory.checkpoint.save import atomic_folder, is_quantized_part, meta_model, write_shard
from accessory.errors import CheckpointError
from accessory.network.LLM import model_classes
from accessory.text.tokenizer import SIDE_FILES, TOKENIZER_FILES, find_tokenizer_for
from accessory.parallel import Shard, global_shape, shard_of

log = logging.getLogger(__name__)

# Copied from the inputs into the output: for each name, the last input folder's copy (the one loading wins).
COPIED_FILES = ("meta.json", *CONFIG_FILES, *TOKENIZER_FILES, *SIDE_FILES)

Recipe = Callable[[], dict[str, list[Term]]]  # opens the inputs: output tensor name -> the terms that sum to it


def reshard(src: Path, dst: Path, shards: int, dtype: Optional[torch.dtype] = None) -> Path:
    """Write checkpoint `src` (any format and shard count) as `shards` shards in a new folder `dst`; a delta folder
    stays a delta folder. Tensors keep their dtype unless `dtype` is given."""
    src = Path(src)
    kind = "accessory-delta" if find_shards(src).kind in ADDITIVE else "accessory"
    return write_streamed(Path(dst), kind, [src], shards, lambda: open_checkpoint([src]), dtype, "resharding")


def write_streamed(dst: Path, kind: str, folders: Sequence[Path], shards: int, recipe: Recipe,
                   dtype: Optional[torch.dtype], verb: str) -> Path:
    """Write the tensors `recipe` describes as `shards` shard files of format `kind` in a new folder `dst`, each the
    float32 sum of its terms rounded once to `dtype` (default: the first term's dtype), or a plain copy. A
    quantized checkpoint's parts are cut as they are (in safetensors files, as save.py writes them)."""
    refuse_overlap(dst, folders)
    args, transformer, llama_type, quantization = _model_type(folders)
    args.check_parallel_size(shards)
    if quantization is not None and (len(folders) > 1 or kind != "accessory"):
        raise CheckpointError(f"{folders[-1]} is quantized ({quantization.quant}): it can be resharded, but deltas "
                              f"are taken between float checkpoints (quantize after applying them)")
    formats = quantization.tensors if quantization else None

    def opened() -> dict[str, list[Term]]:
        return {key: terms for key, terms in recipe().items() if key not in IGNORED_KEYS}  # Meta's rope.freqs

    terms = opened()
    _check_layouts(terms, meta_model(transformer, args, 0, 1, formats), shards)  # every tensor, whole
    count = len(terms)
    del terms  # holds the inputs' mappings: each output shard opens its own
    log.info("%s %s (%s, %d tensors) into %d shard(s) at %s", verb, ", ".join(map(str, folders)), llama_type,
             count, shards, dst)
    with atomic_folder(dst) as tmp, tqdm(total=shards * count, desc=f"{verb} {dst.name}", leave=False) as bar:
        for rank in range(shards):
            model = meta_model(transformer, args, rank, shards, formats)
            out = _cut(opened(), model, rank, dtype, bar)  # reopened: the last shard's mapped pages are let go
            write_shard(out, tmp, kind, rank, shards, safetensors=quantization is not None)
            del out
        _copy_files(folders, tmp)
    return dst


def refuse_overlap(dst: Path, folders: Sequence[Path]) -> None:
    for folder in folders:
        if dst.resolve() == folder.resolve() or dst.resolve().is_relative_to(folder.resolve()):
            raise CheckpointError(f"output {dst} is the input folder {folder} or inside it; choose an output "
                                  f"outside the inputs (inputs are never overwritten)")


def _model_type(folders: Sequence[Path]):
    """(ModelArgs, Transformer class, llama_type, Quantization or None) from the folders' config files, merged as
    loading merges them."""
    spec = read_spec(list(folders))
    model_args, transformer = model_classes(spec.llama_type)
    config = resolved_config(spec.config, find_tokenizer_for(folders), str(folders[-1]))
    args = model_args.from_dict(config, source=f"config of {folders[-1]}")
    return args, transformer, spec.llama_type, spec.quantization


def _saved_params(model) -> dict:
    """Checkpoint name -> (meta tensor, its Shard) for the tensors a checkpoint of `model` holds."""
    return {name: (t, shard_of(model, name)) for name, t in model.saved_tensors().items()}


def _check_layouts(terms: dict[str, list[Term]], model, shards: int) -> None:
    """Before writing: every tensor of the model assembles into the config's shape in every input; a tensor the
    model does not define (its split is unknown) can only be carried over at its own shard count."""
    params = _saved_params(model)
    for key, key_terms in terms.items():
        for term in key_terms:
            if key in params:
                param, shard = params[key]
                piece_layout(term.pieces, global_shape(param, shard), f"{term.folder}: tensor {key!r}")
            elif len(term.pieces) != shards:
                raise CheckpointError(
                    f"{term.folder}: tensor {key!r} is not a parameter of the model type in meta.json, so how it is "
                    f"split is unknown: it can be carried over at its own shard count ({len(term.pieces)}), not "
                    f"resharded to {shards}; use that shard count, or the llama_type that defines it")
        shapes = {tuple(p.shape for p in term.pieces) for term in key_terms} if key not in params else set()
        if len(shapes) > 1:
            raise CheckpointError(f"tensor {key!r} has different shard shapes in "
                                  f"{[str(t.folder) for t in key_terms]}: {sorted(shapes)}")


def _cut(terms: dict[str, list[Term]], model, rank: int, dtype, bar) -> dict[str, torch.Tensor]:
    """Output shard `rank`: every tensor's slice for that rank (the whole tensor where it is not split)."""
    params, elsewhere = _saved_params(model), model.held_elsewhere()  # another shard's experts are left out
    plans = {key: _plan(params, key, key_terms, rank) for key, key_terms in terms.items() if key not in elsewhere}
    # One float32 buffer for every sum of the shard: a buffer allocated and freed per tensor fragments the heap.
    sizes = [2 * shape.numel() for shape, _, key_terms in plans.values() if len(key_terms) > 1]
    scratch = torch.empty(max(sizes), dtype=torch.float32) if sizes else None
    out = {}
    for key, (shape, shard, key_terms) in plans.items():
        keep_dtype = dtype is None or (key in params and is_quantized_part(model, key))
        dest = torch.empty(shape, dtype=key_terms[0].pieces[0].dtype if keep_dtype else dtype)
        copy_sum(dest, key_terms, shard, key, scratch)
        out["llma." + key] = dest
        bar.update()
    return out


def _plan(params: dict, key: str, terms: list[Term], rank: int) -> tuple[torch.Size, Optional[Shard], list[Term]]:
    """(shape of the output tensor, the Shard to read with, the terms to read) of one tensor of shard `rank`."""
    if key not in params:  # carried over shard by shard (checked: same shard count)
        terms = [term._replace(pieces=[term.pieces[rank]]) for term in terms]
        return torch.Size(terms[0].pieces[0].shape), None, terms
    param, shard = params[key]
    shape = global_shape(param, shard)
    if shard is not None:  # saved without the padding of an uneven split, as save.py saves
        shape[shard.dim] = shard.stop - shard.start
        shard = replace(shard, local_size=shard.stop - shard.start)
    return torch.Size(shape), shard, terms


def _copy_files(folders: Sequence[Path], tmp: Path) -> None:
    for name in COPIED_FILES:
        for folder in reversed(folders):
            if (folder / name).is_file():
                shutil.copyfile(folder / name, tmp / name)
                break
