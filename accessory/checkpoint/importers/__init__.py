"""Importers: read a checkpoint (an HF `LlamaForCausalLM` folder, a llama.cpp GGUF file, accessory or Meta shards, a
torch.distributed.checkpoint folder) into our canonical in-memory form, an `ImportedModel`; `hf.write_hf` writes
that form back out as an HF folder.

Canonical form: Meta's LLaMA parameter names without prefix (`tok_embeddings.weight`,
`layers.{i}.attention.wq.weight`, ..., `norm.weight`, `output.weight`), full (unsharded) tensors, q/k in Meta's
interleaved RoPE layout, `output.weight` absent when the embeddings are tied; a config dict holding `ModelArgs` keys
only; and the tokenizer files to copy beside the weights.

Each format has one module with one key-template table; the shared strict-matching and shape checks are in
common.py.
"""
from pathlib import Path

from accessory.checkpoint.importers.common import ImportedModel, expand_templates, expected_shapes
from accessory.checkpoint.importers.dcp import read_dcp
from accessory.checkpoint.importers.gguf import read_gguf
from accessory.checkpoint.importers.hf import (hf_to_meta_qk, meta_to_hf_qk, read_causal_lm, read_hf_config,
                                               write_hf)
from accessory.checkpoint.importers.hf_llava import read_llava
from accessory.checkpoint.importers.shards import read_sharded


def read_hf(folder) -> ImportedModel:
    """An HF folder: a causal LM of a known family (hf.py), or a LLaVA model (hf_llava.py: its language model
    through hf.py, the vision tower and projector as they are)."""
    hf = read_hf_config(folder)
    return read_llava(Path(folder), hf) if hf.get("model_type") == "llava" else read_causal_lm(Path(folder), hf)


__all__ = ["ImportedModel", "read_gguf", "read_hf", "write_hf", "read_sharded", "read_dcp", "hf_to_meta_qk",
           "meta_to_hf_qk", "expand_templates", "expected_shapes"]
