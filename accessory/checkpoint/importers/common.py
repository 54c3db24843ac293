"""What every importer shares: the canonical in-memory form (`ImportedModel`), key-template expansion, strict
renaming, and shape checks against the config."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import torch

from accessory.errors import CheckpointError, ConfigError, listing


@dataclass
class ImportedModel:
    state_dict: Mapping[str, torch.Tensor]  # canonical names, full (unsharded) tensors; a dict, or LazyTensors
    config: dict  # ModelArgs keys only
    tokenizer_files: list[Path] = field(default_factory=list)  # files to copy beside the weights
    llama_type: str = "llama"
    # weight name -> "int8" / "int4" for weights kept quantized (their parts NAME.q, NAME.scale[, NAME.min] are in
    # state_dict instead of NAME); empty for float weights
    quantization: dict[str, str] = field(default_factory=dict)


class LazyTensors(Mapping):
    """A state dict whose tensors are made when they are read, and not kept: `recipes` maps each name to a function
    of no arguments that makes its tensor, `shapes` to its shape. A writer that reads each name once and lets it go
    holds one tensor at a time beside what it writes, so an import that computes its tensors (a GGUF dequantized)
    never holds the model twice. Each read makes the tensor anew."""

    def __init__(self, recipes: dict[str, Callable[[], torch.Tensor]], shapes: dict[str, tuple]):
        self._recipes, self.shapes = recipes, shapes

    def __getitem__(self, name: str) -> torch.Tensor:
        tensor = self._recipes[name]()
        assert tuple(tensor.shape) == tuple(self.shapes[name]), (name, tensor.shape, self.shapes[name])
        return tensor

    def __contains__(self, name) -> bool:  # Mapping's own would make the tensor to answer
        return name in self._recipes

    def __iter__(self) -> Iterator[str]:
        return iter(self._recipes)

    def __len__(self) -> int:
        return len(self._recipes)


def shapes_of(state_dict: Mapping[str, torch.Tensor]) -> dict[str, tuple]:
    """Name -> shape, without making a LazyTensors' tensors."""
    if isinstance(state_dict, LazyTensors):
        return dict(state_dict.shapes)
    return {name: tuple(t.shape) for name, t in state_dict.items()}


def expand_templates(table: dict[str, str], n_layers: int, n_experts: int = 0) -> dict[str, str]:
    """{foreign template: canonical template} with `{i}` (and `{e}`) -> {foreign name: canonical name} for layers
    0..n_layers-1 (and experts 0..n_experts-1).

    Expanding per layer (rather than matching a regex) makes a layer index beyond the config an unexpected name.
    """
    names = {}
    for foreign, ours in table.items():
        experts = range(n_experts) if "{e}" in foreign else [None]
        layers = range(n_layers) if "{i}" in foreign else [None]
        names.update({foreign.format(i=i, e=e): ours.format(i=i, e=e) for i in layers for e in experts})
    return names


def rename_strict(weights: dict[str, torch.Tensor], names: dict[str, str], source: str,
                  optional: frozenset = frozenset()) -> dict[str, torch.Tensor]:
    """Rename `weights` by `names`; any name outside the table, or a table name missing (unless in `optional`,
    given as canonical names), is a CheckpointError naming `source` and the names."""
    unexpected = sorted(set(weights) - set(names))
    if unexpected:
        raise CheckpointError(f"{source}: unexpected weight name(s) {bracketed(unexpected)}; a checkpoint of this "
                              f"family has only names like {bracketed(sorted(names), 4)}")
    missing = sorted(k for k, v in names.items() if k not in weights and v not in optional)
    if missing:
        raise CheckpointError(f"{source}: missing weight(s) {bracketed(missing)}")
    return {names[k]: v for k, v in weights.items()}


def expected_shapes(args, llama_type: str = "llama") -> dict[str, tuple]:
    """Canonical name -> full tensor shape for a `ModelArgs` of `llama_type` (`output.weight` included even when
    tied), as the model itself, built at one rank on the meta device, holds them."""
    from accessory.checkpoint.save import meta_model
    from accessory.network.LLM import model_classes

    model = meta_model(model_classes(llama_type)[1], args, 0, 1)
    shapes = {name: tuple(t.shape) for name, t in model.saved_tensors().items()}
    return {**shapes, "output.weight": (args.vocab_size, args.dim)}


def check_shapes(shapes: dict[str, tuple], args, source: str, llama_type: str = "llama") -> None:
    """CheckpointError listing every canonical tensor whose (float) shape disagrees with the config."""
    expected = expected_shapes(args, llama_type)
    wrong = [f"{k}: {tuple(v)}, expected {expected[k]}" for k, v in shapes.items() if tuple(v) != expected[k]]
    if wrong:
        raise CheckpointError(f"{source}: tensor shape(s) disagree with the config "
                              f"(dim={args.dim}, n_heads={args.n_heads}, n_kv_heads={args.n_kv_heads}, "
                              f"head_dim={args.head_dim}, hidden_dim={args.ffn_hidden_dim}, "
                              f"vocab_size={args.vocab_size}): {bracketed(wrong)}")


def validated_args(config: dict, source: str, llama_type: str = "llama"):
    """The llama_type's `ModelArgs` for a config dict (ConfigError on an unknown key or an impossible
    combination)."""
    # Imported here: the checkpoint layer sits below the model layer, and only needs the config dataclass.
    from accessory.network.LLM import model_classes
    try:
        return model_classes(llama_type)[0].from_dict(config, source=source)
    except ConfigError as e:  # ModelArgs' own checks do not know the file; name it
        if str(e).startswith(source):
            raise
        raise ConfigError(f"{source}: {e}") from e


def bracketed(items: list, limit: int = 8) -> str:
    return f"[{listing(items, limit)}]"
