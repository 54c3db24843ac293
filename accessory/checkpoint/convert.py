"""`accessory convert`: read a checkpoint of any known format into canonical form, write it as another.

| source      | what SRC is                                                       | read by                     |
|-------------|-------------------------------------------------------------------|-----------------------------|
| accessory   | a folder of consolidated.NN-of-MM.model.{pth,safetensors} shards  | importers/shards.py         |
| meta        | Meta's release folder: consolidated.NN.pth + params.json          | importers/shards.py         |
| hf          | an HF LlamaForCausalLM folder                                     | importers/__init__ `read_hf` |
| gguf        | a llama.cpp .gguf file                                            | importers/gguf.py           |
| dcp         | a torch.distributed.checkpoint folder (.metadata + *.distcp)      | importers/dcp.py            |

Targets: `accessory` (save.py, at --shards N) and `hf` (importers/hf.py `write_hf`). Every read goes through one
canonical form (full tensors under Meta names, q/k interleaved), so any source reaches any target.
"""
from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path
from typing import Optional, Sequence

import torch

from accessory.checkpoint.shard_files import find_shards
from accessory.checkpoint.save import check_new_folder, save_checkpoint
from accessory.errors import CheckpointError

log = logging.getLogger(__name__)
SOURCES = ("accessory", "meta", "hf", "gguf", "dcp")
TARGETS = ("accessory", "hf")
# Sources that carry their own config and tokenizer; the others may take them from flags.
SELF_DESCRIBING = ("hf", "gguf")


def convert(source: str, src: Path, dst: Path, shards: Optional[int] = 1, dtype: Optional[torch.dtype] = None,
            target: str = "accessory", llama_type: Optional[str] = None, llama_config: Sequence[str] = (),
            tokenizer_path=None, max_shard_bytes: int = 5 << 30, keep_quantized: bool = False) -> Path:
    """Convert checkpoint `src` of format `source` into a new folder `dst` of format `target`. `keep_quantized`
    (GGUF to accessory): Q8_0 / Q4_0 / Q4_1 tensors keep their bits, as int8 / int4, and Q4_K / Q5_K / Q6_K / Q5_0
    ones their blocks (quant/formats.py)."""
    _check_request(source, target, Path(src), Path(dst), shards, llama_type, llama_config, tokenizer_path)
    if keep_quantized and (source, target) != ("gguf", "accessory"):
        raise CheckpointError("--keep-quantized applies to GGUF sources converted to accessory shards")
    log.info("converting %s checkpoint %s to %s at %s", source, src, target, dst)
    with tempfile.TemporaryDirectory(prefix="accessory-import-") as work:
        model = read(source, Path(src), Path(work), llama_type, llama_config, tokenizer_path, keep_quantized)
        if target == "hf":
            from accessory.checkpoint.importers import write_hf
            return write_hf(model, dst, dtype, max_shard_bytes, source=str(src))
        return save_checkpoint(dst, model.state_dict, model.config, shards or 1, model.tokenizer_files,
                               model.llama_type, dtype=dtype, quantization=model.quantization)


def read(source: str, src: Path, workdir: Path, llama_type=None, llama_config: Sequence[str] = (),
         tokenizer_path=None, keep_quantized: bool = False):
    """`src` in canonical form (an ImportedModel)."""
    from accessory.checkpoint import importers

    if source == "gguf":
        return importers.read_gguf(src, workdir, keep_quantized)
    if source == "hf":
        return importers.read_hf(src)
    tokenizer_path = _canonical_tokenizer(tokenizer_path, workdir)
    if source in ("accessory", "meta"):
        kind = find_shards(src).kind
        if kind != source:
            raise CheckpointError(f"{src}: holds {kind} shards, not {source} ones; convert it as {kind!r}")
        if source == "meta" and not (src / "params.json").is_file() and not llama_config:
            raise CheckpointError(f"{src}: no params.json; Meta's release folders carry one (or pass --llama_config)")
        return importers.read_sharded(src, llama_type, llama_config, tokenizer_path)
    if source == "dcp":
        return importers.read_dcp(src, llama_type, llama_config, tokenizer_path)
    raise ValueError(f"unknown source format {source!r}; known: {SOURCES}")


def _canonical_tokenizer(path, workdir: Path):
    """A tokenizer given by flag under another name (tokenizer.model.v1, say) is copied as tokenizer.model /
    tokenizer.json: the output must hold it under the name that loading looks for."""
    if path is None or Path(path).name in ("tokenizer.model", "tokenizer.json") or Path(path).is_dir():
        return path
    target = workdir / ("tokenizer.json" if Path(path).suffix == ".json" else "tokenizer.model")
    shutil.copyfile(path, target)
    return target


def _check_request(source, target, src: Path, dst: Path, shards, llama_type, llama_config, tokenizer_path) -> None:
    if source not in SOURCES or target not in TARGETS:
        raise ValueError(f"cannot convert {source!r} to {target!r}; sources {SOURCES}, targets {TARGETS}")
    if source == target:
        hint = "accessory reshard SRC DST --shards N" if source == "accessory" else "the folder as it is"
        raise CheckpointError(f"{src} is already {source}: nothing to convert (use {hint})")
    if dst.resolve() == src.resolve():
        raise CheckpointError(f"{dst} already exists; choose a new output folder (inputs are never overwritten)")
    check_new_folder(dst)
    if target == "hf" and shards not in (None, 1):
        raise CheckpointError(f"--shards {shards}: an HF folder is not tensor-parallel; shards are sized by "
                              f"--max_shard_size instead")
    if source in SELF_DESCRIBING and (llama_type or llama_config or tokenizer_path):
        raise CheckpointError(f"a {source} checkpoint carries its own config and tokenizer; --llama_type, "
                              f"--llama_config and --tokenizer_path apply to accessory, meta and dcp sources")
