"""Import a foreign checkpoint (GGUF file, HF LlamaForCausalLM folder) as a sharded accessory checkpoint."""
from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import Optional

import torch

from accessory.checkpoint.save import save_checkpoint

log = logging.getLogger(__name__)
SOURCES = ("gguf", "hf")


def convert(source: str, src: Path, dst: Path, shards: int, dtype: Optional[torch.dtype] = None) -> Path:
    from accessory.checkpoint.importers import read_gguf, read_hf

    log.info("importing %s checkpoint %s as %d shard(s) into %s", source, src, shards, dst)
    with tempfile.TemporaryDirectory(prefix="accessory-import-") as work:
        if source == "gguf":
            imported = read_gguf(Path(src), Path(work))
        elif source == "hf":
            imported = read_hf(Path(src))
        else:
            raise ValueError(f"unknown source format {source!r}; known: {SOURCES}")
        return save_checkpoint(dst, imported.state_dict, imported.config, shards, imported.tokenizer_files,
                               dtype=dtype)
