"""What every importer shares: the canonical in-memory form (`ImportedModel`), key-template expansion, strict
renaming, and shape checks against the config."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from accessory.errors import CheckpointError, ConfigError


@dataclass
class ImportedModel:
    state_dict: dict[str, torch.Tensor]  # canonical names, full (unsharded) tensors
    config: dict  # ModelArgs keys only
    tokenizer_files: list[Path] = field(default_factory=list)  # files to copy beside the weights
    llama_type: str = "llama"
    # weight name -> "int8" / "int4" for weights kept quantized (their parts NAME.q, NAME.scale[, NAME.min] are in
    # state_dict instead of NAME); empty for float weights
    quantization: dict[str, str] = field(default_factory=dict)


def expand_templates(table: dict[str, str], n_layers: int) -> dict[str, str]:
    """{foreign template: canonical template} with `{i}` -> {foreign name: canonical name} for layers 0..n_layers-1.

    Expanding per layer (rather than matching a regex) makes a layer index beyond the config an unexpected name.
    """
    names = {}
    for foreign, ours in table.items():
        if "{i}" in foreign:
            names.update({foreign.format(i=i): ours.format(i=i) for i in range(n_layers)})
        else:
            names[foreign] = ours
    return names


def rename_strict(weights: dict[str, torch.Tensor], names: dict[str, str], source: str,
                  optional: frozenset = frozenset()) -> dict[str, torch.Tensor]:
    """Rename `weights` by `names`; any name outside the table, or a table name missing (unless in `optional`,
    given as canonical names), is a CheckpointError naming `source` and the names."""
    unexpected = sorted(set(weights) - set(names))
    if unexpected:
        raise CheckpointError(f"{source}: unexpected weight name(s) {_clip(unexpected)}; a LLaMA checkpoint has "
                              f"only names like {_clip(sorted(names), 4)}")
    missing = sorted(k for k, v in names.items() if k not in weights and v not in optional)
    if missing:
        raise CheckpointError(f"{source}: missing weight(s) {_clip(missing)}")
    return {names[k]: v for k, v in weights.items()}


def expected_shapes(args) -> dict[str, tuple]:
    """Canonical name -> full tensor shape for a `ModelArgs` (`output.weight` included even when tied)."""
    q, kv, hidden = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim, args.ffn_hidden_dim
    per_layer = {
        "attention.wq.weight": (q, args.dim), "attention.wk.weight": (kv, args.dim),
        "attention.wv.weight": (kv, args.dim), "attention.wo.weight": (args.dim, q),
        "feed_forward.w1.weight": (hidden, args.dim), "feed_forward.w2.weight": (args.dim, hidden),
        "feed_forward.w3.weight": (hidden, args.dim),
        "attention_norm.weight": (args.dim,), "ffn_norm.weight": (args.dim,),
    }
    shapes = {"tok_embeddings.weight": (args.vocab_size, args.dim), "norm.weight": (args.dim,),
              "output.weight": (args.vocab_size, args.dim)}
    for i in range(args.n_layers):
        shapes.update({f"layers.{i}.{k}": v for k, v in per_layer.items()})
    return shapes


def check_shapes(shapes: dict[str, tuple], args, source: str) -> None:
    """CheckpointError listing every canonical tensor whose (float) shape disagrees with the config."""
    expected = expected_shapes(args)
    wrong = [f"{k}: {tuple(v)}, expected {expected[k]}" for k, v in shapes.items() if tuple(v) != expected[k]]
    if wrong:
        raise CheckpointError(f"{source}: tensor shape(s) disagree with the config "
                              f"(dim={args.dim}, n_heads={args.n_heads}, n_kv_heads={args.n_kv_heads}, "
                              f"hidden_dim={args.ffn_hidden_dim}, vocab_size={args.vocab_size}): {_clip(wrong)}")


def validated_args(config: dict, source: str):
    """`ModelArgs` for a config dict (ConfigError on an unknown key or an impossible combination)."""
    # Imported here: the checkpoint layer sits below the model layer, and only needs the config dataclass.
    from accessory.model.LLM.llama import ModelArgs
    try:
        return ModelArgs.from_dict(config, source=source)
    except ConfigError as e:  # ModelArgs' own checks do not know the file; name it
        if str(e).startswith(source):
            raise
        raise ConfigError(f"{source}: {e}") from e


def _clip(items: list, limit: int = 8) -> str:
    shown = ", ".join(str(x) for x in items[:limit])
    return f"[{shown}{f', ... ({len(items) - limit} more)' if len(items) > limit else ''}]"
