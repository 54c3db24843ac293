"""Load this rank's slice of every parameter from checkpoint shards, for any shard count N and rank count M.

A checkpoint tensor is split across its N shards along at most one dimension; which one is read off the shapes
(a piece whose shape equals the model's global shape is a replica). The model side says what it wants through
each parameter's `Shard` (parallel/layers.py). Copying intersects the two, so N -> M works whether or not one
divides the other, and whether or not the two split the same dimension (Meta's LLaMA-3 splits the embedding by
vocabulary, fairscale by feature). Only the pages of the needed slices are read from the memory-mapped files.

Folders stack: a later folder's tensor replaces an earlier one's, except a delta folder's (`model-diff` shards),
which is added to it (`copy_sum`: float32, rounded once). The on-disk tools (reshard.py, delta.py) cut their
output shards with the same `copy_sum`, so what they write is what loading the inputs would give.
"""
from __future__ import annotations

import logging
import re
from functools import partial
from pathlib import Path
from typing import Callable, NamedTuple, Optional, Sequence

import torch
from torch import nn
from tqdm import tqdm

from accessory.checkpoint.shard_files import ADDITIVE, IGNORED_KEYS, Piece, find_shards, read_shard
from accessory.errors import CheckpointError, listing
from accessory.parallel import Shard, global_shape, shard_of
from accessory.parallel.quantized_weight import QuantizedWeight

log = logging.getLogger(__name__)


class Term(NamedTuple):
    """One folder's copy of a tensor (its piece in every shard), added to the others with `sign`."""
    pieces: list[Piece]
    folder: Path
    sign: int = 1


def open_checkpoint(folders: Sequence[Path]) -> dict[str, list[Term]]:
    """Tensor name -> the terms whose sum it is: a later folder replaces the earlier ones' value, except a delta
    folder (formats.ADDITIVE), whose tensors add to it."""
    sources = {}
    for folder in folders:
        shards = find_shards(folder)
        opened = [read_shard(path, shards.kind) for path in shards.files]
        keys = list(dict.fromkeys(key for tensors in opened for key in tensors))  # in the shards' order
        for path, tensors in zip(shards.files, opened):
            absent = [key for key in keys if key not in tensors and not EXPERT_KEY.search(key)]
            if absent:
                raise CheckpointError(f"{path}: lacks tensors other shards of {folder} hold ({listing(absent)}); "
                                      f"the shards are from different checkpoints")
        for key in keys:  # an expert's pieces: those of the shards holding it, in shard order
            term = Term([tensors[key] for tensors in opened if key in tensors], folder)
            sources[key] = sources.get(key, []) + [term] if shards.kind in ADDITIVE else [term]
    return sources


# A mixture's expert tensors (`layers.N.feed_forward.experts.E.w1.weight`, global expert ids) are held only by the
# shards their expert is placed on (parallel/layers.py `expert_placement`); every other tensor is in every shard.
EXPERT_KEY = re.compile(r"\.experts\.\d+\.")


def load_weights(model: nn.Module, folders: Sequence[Path], progress: bool = True) -> None:
    """Fill every tensor of a materialized model from the checkpoint folders; keys must match exactly.

    A quantized weight (quantized_weight.py) loads its parts as they are from a quantized checkpoint, or is quantized
    while loading from a float one: this rank's float slice, one tensor at a time, so no float copy of the whole
    model ever exists."""
    sources = {key: terms for key, terms in open_checkpoint(folders).items()
               if not model.on_other_stage(key)}  # another pipeline stage's: never read here
    units = _load_units(model, sources)
    problem = key_mismatch(sources.keys(), {key for keys, _ in units for key in keys} | model.held_elsewhere())
    if problem:
        raise CheckpointError(f"{', '.join(str(f) for f in folders)}: {problem}")
    for keys, load in tqdm(units, desc="loading weights", disable=not progress, leave=False):
        load()


def _load_units(model: nn.Module, sources: dict[str, list[Term]]) -> list[tuple[list[str], Callable[[], None]]]:
    """(the checkpoint keys it reads, how to load it) for each tensor, or quantized weight, of the model."""
    units = []
    for name, tensor in _distinct_tensors(model).items():  # this rank's (its experts', not the others')
        owner_name, _, part = name.rpartition(".")
        owner = model.get_submodule(owner_name) if owner_name else model
        key = model.checkpoint_key(name)
        if not isinstance(owner, QuantizedWeight):
            units.append(([key], partial(copy_sum, tensor.data, sources.get(key), shard_of(model, name), key)))
        elif model.checkpoint_key(owner_name) in sources:  # a float checkpoint: quantize this rank's slice
            if part == "q":
                float_key = model.checkpoint_key(owner_name)
                units.append(([float_key], partial(_quantize_slice, owner, sources[float_key], float_key)))
        else:
            units.append(([key], partial(_copy_part, tensor, sources.get(key), shard_of(model, name), key)))
    return units


def _distinct_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor a checkpoint fills (parameters and quantized parts), each once: a tensor two modules share (a
    tied output at one rank) under its first name."""
    seen, tensors = set(), {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            tensors[name] = tensor
    return tensors


def _quantize_slice(weight: QuantizedWeight, terms: list[Term], key: str) -> None:
    local = torch.empty(weight.shape, dtype=torch.float32, device=weight.q.device)
    copy_sum(local, terms, weight.shard, key)
    weight.quantize_from(local)


def _copy_part(part: torch.Tensor, terms: list[Term], shard: Optional[Shard], key: str) -> None:
    if len(terms) > 1:
        raise CheckpointError(f"{terms[-1].folder}: a delta cannot be added to the quantized tensor {key!r} of "
                              f"{terms[0].folder}; apply deltas to float weights, then quantize")
    for term in terms:
        dtype = term.pieces[0].dtype
        if dtype is not None and dtype != part.dtype:
            raise CheckpointError(f"{term.folder}: quantized tensor {key!r} is {dtype}; its format stores "
                                  f"{part.dtype}")
    copy_sum(part, terms, shard, key)


def copy_sum(dest: torch.Tensor, terms: list[Term], shard: Optional[Shard], key: str,
             scratch: Optional[torch.Tensor] = None) -> None:
    """`copy_slice` of the signed sum of `terms`: one term is copied as it is; a base and its deltas are summed in
    float32 (float64 for a float64 `dest`) and rounded to dest's dtype once. `scratch` (1-D, of that dtype, at least
    2 * dest.numel() long) is used for the sum instead of new buffers."""
    if len(terms) == 1 and terms[0].sign == 1:
        copy_slice(dest, terms[0].pieces, shard, f"{terms[0].folder}: tensor {key!r}")
        return
    dtype, n = torch.promote_types(dest.dtype, torch.float32), dest.numel()
    if scratch is None or scratch.dtype != dtype or scratch.numel() < 2 * n:
        scratch = torch.empty(2 * n, dtype=dtype, device=dest.device)
    acc, part = scratch[:n].view(dest.shape).zero_(), scratch[n:2 * n].view(dest.shape)
    for term in terms:
        copy_slice(part, term.pieces, shard, f"{term.folder}: tensor {key!r}")
        acc.add_(part, alpha=term.sign)
    dest.copy_(acc)


def key_mismatch(found, wanted) -> Optional[str]:
    """What is wrong with a checkpoint holding tensors `found` for a model that loads `wanted`, or None."""
    missing = sorted(set(wanted) - set(found))
    unexpected = sorted(set(found) - set(wanted) - IGNORED_KEYS)
    if missing:
        return (f"checkpoint lacks {len(missing)} tensor(s) the model needs: {listing(missing)} "
                f"(wrong llama_type or config, or a partial checkpoint?)")
    if unexpected:
        return (f"checkpoint has {len(unexpected)} tensor(s) the model does not use: {listing(unexpected)} "
                f"(wrong llama_type or config?)")
    return None


def copy_slice(dest: torch.Tensor, pieces: list[Piece], shard: Optional[Shard], what: str) -> None:
    """Copy the part of the global tensor (split across `pieces`) that `shard` selects into `dest`."""
    full_shape = global_shape(dest, shard)
    if shard is not None:
        if shard.stop - shard.start < shard.local_size:
            dest.zero_()  # padding of an uneven split must be zeros (see parallel/layers.py)
    for piece, piece_dim, offset in piece_layout(pieces, full_shape, what):
        src = [slice(None)] * dest.dim()
        dst = [slice(None)] * dest.dim()
        if shard is not None and piece_dim == shard.dim:
            lo, hi = max(shard.start, offset), min(shard.stop, offset + piece.shape[piece_dim])
            if lo >= hi:
                continue
            src[shard.dim], dst[shard.dim] = slice(lo - offset, hi - offset), slice(lo - shard.start, hi - shard.start)
        else:
            if shard is not None:
                src[shard.dim] = slice(shard.start, shard.stop)
                dst[shard.dim] = slice(0, shard.stop - shard.start)
            if piece_dim is not None:
                dst[piece_dim] = slice(offset, offset + piece.shape[piece_dim])
        dest[tuple(dst)].copy_(piece.read(tuple(src)))


def piece_layout(pieces: list[Piece], full_shape: list[int], what: str) -> list[tuple[Piece, Optional[int], int]]:
    """(piece, the dimension the checkpoint split, the piece's offset along it) for the distinct pieces."""
    shapes = [list(p.shape) for p in pieces]
    if all(s == full_shape for s in shapes):
        return [(pieces[0], None, 0)]  # replicated in every shard (or a single shard)
    split = [d for d in range(len(full_shape)) if len(shapes[0]) == len(full_shape) and shapes[0][d] != full_shape[d]]
    mismatch = CheckpointError(f"{what}: shard shape(s) {_shapelisting(shapes)} do not assemble into the model's "
                               f"shape {full_shape} (wrong config or llama_type?)")
    if len(split) != 1 or any(s[:split[0]] + s[split[0] + 1:] != shapes[0][:split[0]] + shapes[0][split[0] + 1:]
                              for s in shapes):
        raise mismatch
    dim = split[0]
    total = sum(s[dim] for s in shapes)
    if total != full_shape[dim]:
        # More shards than KV heads: consecutive shards hold copies of one KV head. Keep one of each run.
        copies = total // full_shape[dim]
        if total % full_shape[dim] or len({s[dim] for s in shapes}) != 1 or len(pieces) % copies:
            raise mismatch
        pieces = pieces[::copies]
    offsets, layout = 0, []
    for piece in pieces:
        layout.append((piece, dim, offsets))
        offsets += piece.shape[dim]
    return layout


def _shapelisting(shapes: list[list[int]]) -> str:
    distinct = []
    for s in shapes:
        if s not in distinct:
            distinct.append(s)
    return ", ".join(str(s) for s in distinct)


def split_dim(pieces: list[Piece], full_shape: list[int], what: str) -> Optional[int]:
    """The dimension the checkpoint split a tensor along across its shards (None: replicated, or one shard), as
    loading reads it; CheckpointError naming `what` if the pieces do not assemble into `full_shape`."""
    return piece_layout(pieces, list(full_shape), what)[0][1]


def assemble(pieces: list[Piece], full_shape: list[int], what: str) -> torch.Tensor:
    """The whole tensor (in the shards' dtype) that `pieces` are split from, shaped `full_shape`."""
    layout = piece_layout(pieces, list(full_shape), what)
    if layout[0][1] is None:
        return layout[0][0].read(())  # one piece is the whole tensor: a view of the memory-mapped file, no copy
    full = torch.empty(full_shape, dtype=pieces[0].dtype)
    copy_slice(full, pieces, None, what)
    return full
