"""`accessory quantize SRC DST --to int4|int8`: write a float checkpoint as a quantized one.

The model is built quantized at one rank and loaded from SRC as `from_pretrained(quant=...)` loads it: tensor by
tensor, each quantized as it is read, so no float copy of the whole model is ever held (peak memory: the quantized
model twice, while it is cut into shards, plus the largest float tensor). The output is save.py's quantized form:
safetensors shards with each quantized weight as its parts, and meta.json's "quantization" saying which weights
are quantized and how. It loads, and reshards, at any rank count like any checkpoint.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

import torch

from accessory.checkpoint.config import read_spec, resolved_config
from accessory.checkpoint.shard_files import find_shards
from accessory.checkpoint.load import load_weights, open_checkpoint
from accessory.checkpoint.reshard import refuse_overlap
from accessory.checkpoint.save import check_new_folder, save_checkpoint
from accessory.errors import CheckpointError
from accessory.network.LLM import model_classes
from accessory.text.tokenizer import find_tokenizer_for
from accessory.parallel import ParallelContext
from accessory.quant.formats import GROUP, check_format

log = logging.getLogger(__name__)


def quantize_checkpoint(src: Path, dst: Path, fmt: str, shards: Optional[int] = None) -> Path:
    """Write checkpoint folder `src` (float, any shard count) into a new folder `dst` with its weights in `fmt`
    ("int8": every linear and the embedding; "int4": the blocks' linears, the embedding and output in int8), as
    `shards` shards (default: src's count). Norms and other small tensors keep src's float dtype."""
    src, dst = Path(src), Path(dst)
    check_format(fmt, "--to", quantizing=True)
    refuse_overlap(dst, [src])
    check_new_folder(dst)
    spec = read_spec([src])
    if spec.quantization is not None:
        raise CheckpointError(f"{src} is already quantized ({spec.quantization.quant}); quantize its float original")
    shards = shards or len(find_shards(src).files)
    tokenizer = find_tokenizer_for([src])
    config = resolved_config(spec.config, tokenizer, str(src))
    model_args, transformer = model_classes(spec.llama_type)
    args = model_args.from_dict(config, source=f"config of {src}")
    args.check_parallel_size(shards)
    for name, size in (("dim", args.dim), ("the FFN hidden size", args.ffn_hidden_dim)):
        if size % GROUP:  # the last group would be partial, and the format stores whole groups of inputs
            raise CheckpointError(f"{src}: {name} ({size}) is not a multiple of {GROUP}, so its weights cannot be "
                                  f"saved quantized; quantize while loading instead (--quant {fmt})")
    with torch.device("meta"):
        model = transformer(args, ParallelContext(None, 0, 1, 0))
    formats = model.quantization_plan(fmt)
    model.quantize_(formats)
    model.materialize(torch.device("cpu"), _float_dtype(src))
    log.info("quantizing %s to %s (%d weights) into %d shard(s) at %s", src, fmt, len(formats), shards, dst)
    load_weights(model, [src])
    return save_checkpoint(dst, model.saved_tensors(), config, shards, tokenizer.files if tokenizer else [],
                           spec.llama_type, quantization=formats)


def _float_dtype(src: Path) -> torch.dtype:
    """The dtype of src's float tensors (its norms'), kept for the tensors that are not quantized."""
    pieces = open_checkpoint([src]).get("norm.weight")
    return pieces[0].pieces[0].dtype if pieces and pieces[0].pieces[0].dtype is not None else torch.float32
