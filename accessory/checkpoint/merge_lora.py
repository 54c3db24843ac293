"""merge-lora: fold a llama_peft checkpoint's LoRA factors into a plain llama checkpoint; or a Hugging Face PEFT
adapter folder into the checkpoint it was trained on (`merge_peft_adapter`, chosen when the last source folder holds
an adapter_config.json).

    W' = W + B A        (B = lora_b (out, rank), A = lora_a (rank, in); LLaMA2-Accessory's LoRA has no scaling)

computed in float32 and saved in the base weights' dtype (or `dtype`). Norms come from the checkpoint as loaded
(a trainable-only folder stacked after its base overrides the base's). A plain llama has no biases, so a
bias_tuning checkpoint merges only if all its biases are zero; otherwise it is refused, naming them (load it as
llama_peft instead, which runs under tensor parallelism as it is).

Peak memory: the whole model once, in the base dtype, plus one output shard while it is written.

    python -m accessory.checkpoint.merge_lora SRC... DST [--shards N] [--dtype fp32|bf16|fp16]

A PEFT adapter merges as W' = W + s B A (peft_adapter.py: s, names, q/k layout), in float32, into any family's
float checkpoint; the output keeps the base's llama_type, config and tokenizer.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional, Sequence, Union

import torch
from torch import nn

from accessory.checkpoint.config import read_spec, resolved_config
from accessory.checkpoint.shard_files import find_shards
from accessory.checkpoint.load import load_weights, open_checkpoint
from accessory.checkpoint.peft_adapter import is_peft_adapter, merged_delta, read_adapter
from accessory.checkpoint.save import check_new_folder, save_checkpoint
from accessory.errors import CheckpointError, listing
from accessory.network.LLM import model_classes
from accessory.text.tokenizer import find_tokenizer_for
from accessory.parallel import LoraColumnParallelLinear, LoraRowParallelLinear, ParallelContext

log = logging.getLogger(__name__)

PEFT_CONFIG_KEYS = ("lora_rank", "bias_tuning", "norm_tuning")  # llama_peft's ModelArgs fields beyond llama's
PEFT_TENSOR_SUFFIXES = (".bias", ".lora_a.weight", ".lora_b.weight")  # tensors a plain llama lacks
LORA_LAYERS = (LoraColumnParallelLinear, LoraRowParallelLinear)
PathLike = Union[str, Path]


def merge_lora(src_folders: Union[PathLike, Sequence[PathLike]], dst: PathLike, shards: Optional[int] = None,
               dtype: Optional[torch.dtype] = None) -> Path:
    """Write the llama_peft checkpoint `src_folders` (a folder, or [base, trainable-only, ...] with later folders
    overriding earlier ones) as a new plain llama checkpoint `dst` with `shards` shards (default: as many as the
    first folder has), atomically, with config and tokenizer files. Returns `dst`."""
    folders = [Path(p) for p in ([src_folders] if isinstance(src_folders, (str, Path)) else src_folders)]
    dst = check_new_folder(dst)  # save_checkpoint refuses too; checked here before minutes of loading
    if is_peft_adapter(folders[-1]):
        return merge_peft_adapter(folders[:-1], folders[-1], dst, shards, dtype)
    spec = read_spec(folders)
    if spec.llama_type != "llama_peft":
        raise CheckpointError(f"{folders[-1]}: llama_type is {spec.llama_type!r}; merge-lora takes a llama_peft "
                              f"checkpoint (meta.json llama_type \"llama_peft\"; a trainable-only folder is given "
                              f"after its base folder)")
    tokenizer = find_tokenizer_for(folders)
    config = resolved_config(spec.config, tokenizer, str(folders[-1]))
    plain_config = {k: v for k, v in config.items() if k not in PEFT_CONFIG_KEYS}
    shards = shards or len(find_shards(folders[0]).files)
    plain_args, _ = model_classes("llama")
    plain_args.from_dict(plain_config, f"config of {folders[-1]}").check_parallel_size(shards)  # before loading
    sources = open_checkpoint(folders)
    if nonzero := _nonzero_biases(sources):
        raise CheckpointError(
            f"{', '.join(map(str, folders))}: cannot merge into a plain llama, which has no biases: "
            f"{len(nonzero)} bias tensor(s) are non-zero: {listing(nonzero)}. Load the checkpoint as llama_peft "
            f"instead (it runs under tensor parallelism as it is)")
    base_dtype = _dtype_of(sources, "tok_embeddings.weight")
    del sources  # unmaps the files it read (loading maps them again)
    model = _load_peft(config, folders, base_dtype)
    state_dict = _merged_state_dict(model, dtype)
    log.info("merging LoRA of %s into %s (%d shard(s))", [str(f) for f in folders], dst, shards)
    return save_checkpoint(dst, state_dict, plain_config, shards, tokenizer.files if tokenizer else [],
                           llama_type="llama", dtype=dtype)


def _nonzero_biases(sources: dict) -> list[str]:
    """Names of the `.bias` tensors with a non-zero element in any shard (read before the model is loaded)."""
    return sorted(key for key, terms in sources.items() if key.endswith(".bias")
                  and any(piece.read((slice(None),)).any() for term in terms for piece in term.pieces))


def _dtype_of(sources: dict, key: str) -> torch.dtype:
    if key not in sources:
        raise CheckpointError(f"checkpoint lacks {key!r}: is the base folder missing from the list?")
    return sources[key][0].pieces[0].dtype


def _load_peft(config: dict, folders: list[Path], dtype: torch.dtype) -> nn.Module:
    """The llama_peft model at one rank on the CPU: weights in `dtype`, LoRA factors in float32 (they may have
    been saved in float32 beside a bf16 base; rounding them before the product would lose that)."""
    model_args, transformer = model_classes("llama_peft")
    args = model_args.from_dict(config, source=f"config of {folders[-1]}")
    with torch.device("meta"):
        model = transformer(args, ParallelContext(None, 0, 1, 0)).to(dtype)
    for layer in _lora_layers(model):
        layer.lora_a.float(), layer.lora_b.float()
    model.to_empty(device="cpu")
    load_weights(model, folders)
    return model


def _lora_layers(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, LORA_LAYERS) and m.lora_a is not None]


@torch.no_grad()
def _merged_state_dict(model: nn.Module, dtype: Optional[torch.dtype]) -> dict[str, torch.Tensor]:
    """The plain llama tensors of the loaded llama_peft `model`, each LoRA'd weight replaced by W + B A."""
    for layer in _lora_layers(model):
        merged = layer.weight.float() + layer.lora_b.weight @ layer.lora_a.weight  # (out, rank) @ (rank, in)
        layer.weight.data = merged.to(dtype or layer.weight.dtype)  # replaces W's storage: one copy in memory
    # What a plain llama holds: everything but the biases and LoRA factors (save_checkpoint checks the key set).
    return {name: p.data for name, p in model.named_parameters()
            if model.checkpoint_key(name) == name and not name.endswith(PEFT_TENSOR_SUFFIXES)}


def merge_peft_adapter(base_folders: Sequence[PathLike], adapter: PathLike, dst: PathLike,
                       shards: Optional[int] = None, dtype: Optional[torch.dtype] = None) -> Path:
    """Write the checkpoint `base_folders` with the PEFT adapter folder `adapter` merged (W + s B A) as a new
    checkpoint `dst` of the same llama_type, with `shards` shards (default: as many as the first base folder has),
    atomically, with config and tokenizer files. Returns `dst`."""
    folders, dst = [Path(p) for p in base_folders], Path(dst)
    if not folders:
        raise CheckpointError(f"merge-lora of the PEFT adapter {adapter}: give the base checkpoint folder before it")
    check_new_folder(dst)
    spec = read_spec(folders)
    if spec.quantization is not None:
        raise CheckpointError(f"{folders[-1]} holds quantized weights; merge the adapter into the float checkpoint "
                              f"(quantize the result afterwards with `accessory quantize`)")
    tokenizer = find_tokenizer_for(folders)
    config = resolved_config(spec.config, tokenizer, str(folders[-1]))
    model_args, transformer = model_classes(spec.llama_type)
    args = model_args.from_dict(config, source=f"config of {folders[-1]}")
    shards = shards or len(find_shards(folders[0]).files)
    args.check_parallel_size(shards)  # before loading
    peft = read_adapter(adapter, args)
    base_dtype = _dtype_of(open_checkpoint(folders), "tok_embeddings.weight")
    with torch.device("meta"):
        model = transformer(args, ParallelContext(None, 0, 1, 0)).to(base_dtype)
    model.to_empty(device="cpu")
    load_weights(model, folders)
    with torch.no_grad():
        for name in peft.factors:
            weight = model.get_submodule(name).weight
            weight.data = (weight.float() + merged_delta(peft, name)).to(dtype or weight.dtype)
    state_dict = {name: p.data for name, p in model.named_parameters() if model.checkpoint_key(name) == name}
    log.info("merging the PEFT adapter %s into %s as %s (%d shard(s))", adapter, [str(f) for f in folders], dst,
             shards)
    return save_checkpoint(dst, state_dict, config, shards, tokenizer.files if tokenizer else [],
                           llama_type=spec.llama_type, dtype=dtype)
