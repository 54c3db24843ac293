"""Accessory or Meta shard folders (any shard count) -> canonical form, every tensor assembled whole.

What a folder should hold is asked of the model itself: its llama_type's Transformer, built on the meta device at
one rank, names every checkpoint key and its full shape; the shards are then assembled with the loader's own
layout rule (load.py), so what is read here is exactly what `from_pretrained` would load.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

from tqdm import tqdm

from accessory.checkpoint.config import read_spec, resolved_config
from accessory.checkpoint.importers.common import ImportedModel
from accessory.checkpoint.load import assemble, key_mismatch, open_checkpoint
from accessory.errors import CheckpointError
from accessory.text.tokenizer import find_tokenizer_for


def model_layout(llama_type: str, config: dict, source: str,
                 quantization: Optional[dict[str, str]] = None) -> dict[str, tuple[int, ...]]:
    """Checkpoint key -> full tensor shape, for the tensors a model of this llama_type and config loads (the parts
    of the weights `quantization` names, for a quantized checkpoint)."""
    from accessory.checkpoint.save import meta_model
    from accessory.network.LLM import model_classes

    model_args, transformer = model_classes(llama_type, source=source)
    args = model_args.from_dict(config, source=source)
    model = meta_model(transformer, args, 0, 1, quantization)
    return {name: tuple(t.shape) for name, t in model.saved_tensors().items()}


def read_sharded(folder, llama_type: Optional[str] = None, llama_config: Sequence[str] = (),
                 tokenizer_path=None) -> ImportedModel:
    """Every tensor of an accessory (consolidated.NN-of-MM.model.*) or Meta (consolidated.NN.pth + params.json)
    folder, merged from its shards; the config from its meta.json / params.json / config.json (then
    `llama_config`), and its tokenizer files. CheckpointError naming the file and key on any mismatch."""
    folder = Path(folder)
    spec = read_spec([folder], llama_type, llama_config)
    if spec.quantization is not None:
        raise CheckpointError(f"{folder} is quantized ({spec.quantization.quant}); only float checkpoints convert "
                              f"to other formats (convert the float original, or reshard this one)")
    tokenizer = find_tokenizer_for([folder], tokenizer_path)
    config = resolved_config(spec.config, tokenizer, str(folder))
    shapes = model_layout(spec.llama_type, config, f"config of {folder}")
    sources = open_checkpoint([folder])
    problem = key_mismatch(sources.keys(), shapes.keys())
    if problem:
        raise CheckpointError(f"{folder}: {problem}")
    state_dict = {key: assemble(sources[key][0].pieces, list(shape), f"{folder}: tensor {key!r}")
                  for key, shape in tqdm(shapes.items(), desc=f"reading {folder.name}", unit="tensor")}
    return ImportedModel(state_dict, config, tokenizer.files if tokenizer else [], spec.llama_type)
