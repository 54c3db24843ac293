"""Delta weights: `extract` writes fine-tuned minus base as a `model-diff` folder; `apply` writes base plus delta as
a plain checkpoint. Either side may be at any shard count, and the output at any other (reshard.write_streamed).

A delta is LLaMA2-Accessory's `consolidated.NN-of-MM.model-diff.pth` layout, loadable as it is stacked after its
base (`MetaModel.from_pretrained([base, delta])`). `apply` is that same stacking (load.open_checkpoint), written out.
Sums are taken in float32 and rounded once. Over bf16 or fp16 weights an fp32 delta (`dtype=torch.float32` at
extract) is exact, so apply(base, extract(base, ft)) == ft bit for bit; a delta in the weights' own dtype is within
one rounding of the delta and one of the sum.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from accessory.checkpoint.shard_files import ADDITIVE, IGNORED_KEYS, find_shards
from accessory.checkpoint.load import Term, open_checkpoint
from accessory.checkpoint.reshard import write_streamed
from accessory.errors import CheckpointError, listing


def extract_delta(base: Path, finetuned: Path, dst: Path, shards: Optional[int] = None,
                  dtype: Optional[torch.dtype] = None) -> Path:
    """Write `finetuned - base` into a new delta folder `dst` (default: the base's shard count; the fine-tuned
    weights' dtype). Tensors only the fine-tuned checkpoint has (LoRA, biases) are carried over as they are."""
    base, finetuned = Path(base), Path(finetuned)
    base_count = _plain_shards(base, "base")
    _plain_shards(finetuned, "fine-tuned checkpoint")

    def recipe() -> dict[str, list[Term]]:
        base_terms, tuned = open_checkpoint([base]), open_checkpoint([finetuned])
        _require_keys(base_terms, tuned, base, finetuned, "fine-tuned checkpoint")
        return {key: terms + [term._replace(sign=-1) for term in base_terms.get(key, [])]
                for key, terms in tuned.items()}

    return write_streamed(Path(dst), "accessory-delta", [base, finetuned], shards or base_count, recipe, dtype,
                          "extracting")


def apply_delta(base: Path, delta: Path, dst: Path, shards: Optional[int] = None,
                dtype: Optional[torch.dtype] = None) -> Path:
    """Write `base + delta` as a new plain checkpoint `dst` (default: the base's shard count and dtypes)."""
    base, delta = Path(base), Path(delta)
    base_count = _plain_shards(base, "base")
    if (kind := find_shards(delta).kind) not in ADDITIVE:
        raise CheckpointError(f"{delta}: holds {kind} shards, not a delta (consolidated.NN-of-MM.model-diff.pth); "
                              f"make one with `accessory weights extract`")

    def recipe() -> dict[str, list[Term]]:
        stacked = open_checkpoint([base, delta])  # exactly what from_pretrained([base, delta]) loads
        _require_keys(open_checkpoint([base]), stacked, base, delta, "delta",
                      lambda key: stacked[key][-1].folder == delta)
        return stacked

    return write_streamed(Path(dst), "accessory", [base, delta], shards or base_count, recipe, dtype, "applying")


def _plain_shards(folder: Path, role: str) -> int:
    shards = find_shards(folder)
    if shards.kind in ADDITIVE:
        raise CheckpointError(f"{folder}: the {role} is a delta folder (model-diff shards); it must be a full "
                              f"checkpoint (apply the delta to its base first)")
    return len(shards.files)


def _require_keys(base_terms: dict, other: dict, base: Path, folder: Path, role: str, has=None) -> None:
    """Every tensor of the base must be in the other folder: a missing one means they belong to other models."""
    has = has or (lambda key: key in other)
    missing = sorted(key for key in base_terms if key not in IGNORED_KEYS and not has(key))
    if missing:
        raise CheckpointError(f"{folder}: the {role} lacks {len(missing)} tensor(s) of the base {base}: "
                              f"{listing(missing)} (made from another model?)")
