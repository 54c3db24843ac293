"""Hugging Face `LlamaForCausalLM` folders -> canonical form (and the q/k permutation pair an exporter reuses).

HF's q_proj / k_proj rows are in the rotate-half RoPE layout; Meta's (ours) interleave each head's rotary pairs.
HF's convert script applies `meta_to_hf_qk` below; we apply its inverse on import.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from accessory.checkpoint.importers import (ImportedModel, check_shapes, expand_templates, rename_strict,
                                            validated_args)
from accessory.errors import CheckpointError, ConfigError
from accessory.jsonfile import read_json_object

# HF name -> canonical name; `{i}` is the layer index.
HF_TO_META = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.layers.{i}.self_attn.q_proj.weight": "layers.{i}.attention.wq.weight",
    "model.layers.{i}.self_attn.k_proj.weight": "layers.{i}.attention.wk.weight",
    "model.layers.{i}.self_attn.v_proj.weight": "layers.{i}.attention.wv.weight",
    "model.layers.{i}.self_attn.o_proj.weight": "layers.{i}.attention.wo.weight",
    "model.layers.{i}.mlp.gate_proj.weight": "layers.{i}.feed_forward.w1.weight",
    "model.layers.{i}.mlp.down_proj.weight": "layers.{i}.feed_forward.w2.weight",
    "model.layers.{i}.mlp.up_proj.weight": "layers.{i}.feed_forward.w3.weight",
    "model.layers.{i}.input_layernorm.weight": "layers.{i}.attention_norm.weight",
    "model.layers.{i}.post_attention_layernorm.weight": "layers.{i}.ffn_norm.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "output.weight",
}
# Buffers that older transformers saved in pytorch_model.bin; recomputed from the config, so dropped.
_DERIVED_BUFFER_SUFFIX = ".self_attn.rotary_emb.inv_freq"

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "generation_config.json", "chat_template.jinja")


def meta_to_hf_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Meta's interleaved q/k rows -> HF's rotate-half rows (pass n_kv_heads for k), as HF's convert script does."""
    rows, cols = w.shape
    # (n_heads, head_dim/2, 2, cols): pair p of head h holds rows 2p, 2p+1 -> (n_heads, 2, head_dim/2, cols)
    return w.reshape(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def hf_to_meta_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """HF's rotate-half q/k rows -> Meta's interleaved rows (pass n_kv_heads for k); inverse of `meta_to_hf_qk`."""
    rows, cols = w.shape
    # (n_heads, 2, head_dim/2, cols): halves of head h -> (n_heads, head_dim/2, 2, cols), pairs adjacent
    return w.reshape(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def read_hf(folder) -> ImportedModel:
    """Read an HF `LlamaForCausalLM` folder (config.json plus model.safetensors, sharded safetensors with
    model.safetensors.index.json, or pytorch_model.bin, sharded or not) into canonical names, q/k permuted back to
    Meta's layout, tensors in their stored dtype. Raises CheckpointError / ConfigError naming the file and key."""
    folder = Path(folder)
    config_path = folder / "config.json"
    config = config_from_hf(_read_json(config_path), str(config_path))
    args = validated_args(config, source=str(config_path))
    weights, source = _load_weights(folder)
    names = expand_templates(HF_TO_META, args.n_layers)
    state_dict = rename_strict(weights, names, source, optional=frozenset({"output.weight"}))
    if args.tie_word_embeddings:
        _drop_tied_output(state_dict, source)
    elif "output.weight" not in state_dict:
        raise CheckpointError(f"{source}: missing weight lm_head.weight, and {config_path} says "
                              f"tie_word_embeddings is false")
    check_shapes(state_dict, args, source)
    for i in range(args.n_layers):
        wq, wk = f"layers.{i}.attention.wq.weight", f"layers.{i}.attention.wk.weight"
        state_dict[wq] = hf_to_meta_qk(state_dict[wq], args.n_heads)
        state_dict[wk] = hf_to_meta_qk(state_dict[wk], args.n_kv_heads)
    tokenizer_files = [folder / name for name in TOKENIZER_FILES if (folder / name).is_file()]
    return ImportedModel(state_dict=state_dict, config=config, tokenizer_files=tokenizer_files)


def config_from_hf(hf: dict, source: str) -> dict:
    """An HF LlamaConfig dict -> our config dict (ModelArgs keys only). Missing optional keys take HF's defaults."""
    _check_llama(hf, source)
    missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                           "vocab_size") if k not in hf]
    if missing:
        raise ConfigError(f"{source}: missing key(s) {missing} that a LlamaForCausalLM config needs")
    dim, n_heads = hf["hidden_size"], hf["num_attention_heads"]
    if hf.get("head_dim") is not None and n_heads and hf["head_dim"] != dim // n_heads:
        raise ConfigError(f"{source}: head_dim {hf['head_dim']} differs from hidden_size / num_attention_heads "
                          f"({dim} / {n_heads}); a separate head_dim is not supported")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            raise ConfigError(f"{source}: {key} is true; LLaMA layers with biases are not supported")
    if hf.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{source}: hidden_act {hf['hidden_act']!r} is not supported; expected 'silu'")
    rope_theta, rope_scaling = _rope_from_hf(hf, source)
    return {
        "dim": dim,
        "n_layers": hf["num_hidden_layers"],
        "n_heads": n_heads,
        "n_kv_heads": hf.get("num_key_value_heads") or n_heads,
        "vocab_size": hf["vocab_size"],
        "hidden_dim": hf["intermediate_size"],
        "norm_eps": hf.get("rms_norm_eps", 1e-6),
        "rope_theta": rope_theta,
        "rope_scaling": rope_scaling,
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "max_seq_len": hf.get("max_position_embeddings", 2048),
    }


def _check_llama(hf: dict, source: str) -> None:
    architectures = hf.get("architectures")
    if architectures is not None and architectures != ["LlamaForCausalLM"]:
        raise CheckpointError(f"{source}: architectures is {architectures}; only ['LlamaForCausalLM'] "
                              f"can be imported")
    if hf.get("model_type") != "llama":
        raise CheckpointError(f"{source}: model_type is {hf.get('model_type')!r}; only 'llama' can be imported")


# Keys of each rope type we support, as HF names them (and as our dict form keeps them).
_ROPE_KEYS = {"linear": ("factor",),
              "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}


def _rope_from_hf(hf: dict, source: str) -> tuple[float, Optional[dict]]:
    """(rope_theta, our rope_scaling) from transformers<5 `rope_theta` + `rope_scaling` or transformers 5
    `rope_parameters` (which holds rope_theta and the scaling together)."""
    params = hf.get("rope_parameters") or {}
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    scaling = params if params.get("rope_type", "default") != "default" else hf.get("rope_scaling")
    if not scaling:
        return float(theta), None
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if rope_type in (None, "default"):
        return float(theta), None
    if rope_type not in _ROPE_KEYS:
        raise ConfigError(f"{source}: rope scaling type {rope_type!r} is not supported; expected one of "
                          f"{sorted(_ROPE_KEYS)} or 'default'")
    missing = [k for k in _ROPE_KEYS[rope_type] if k not in scaling]
    if missing:
        raise ConfigError(f"{source}: {rope_type} rope scaling lacks key(s) {missing}")
    return float(theta), {"rope_type": rope_type, **{k: scaling[k] for k in _ROPE_KEYS[rope_type]}}


def _drop_tied_output(state_dict: dict, source: str) -> None:
    """Tied embeddings: an `lm_head.weight` that was saved anyway must equal the embeddings; drop it."""
    output = state_dict.pop("output.weight", None)
    if output is not None and not torch.equal(output, state_dict["tok_embeddings.weight"]):
        raise CheckpointError(f"{source}: tie_word_embeddings is true but lm_head.weight differs from "
                              f"model.embed_tokens.weight")


def _load_weights(folder: Path) -> tuple[dict[str, torch.Tensor], str]:
    """All weights of the folder under their HF names, and a description of where they came from (for errors).
    Safetensors are preferred over pytorch_model.bin when both are present."""
    for single, index, loader in (("model.safetensors", "model.safetensors.index.json", _load_safetensors),
                                  ("pytorch_model.bin", "pytorch_model.bin.index.json", _load_bin)):
        if (folder / index).is_file():
            files = _shards_from_index(folder / index)
            source = f"{folder / index}"
        elif (folder / single).is_file():
            files, source = [folder / single], str(folder / single)
        else:
            continue
        weights = {}
        for path in files:
            part = loader(path)
            repeated = sorted(set(part) & set(weights))
            if repeated:
                raise CheckpointError(f"{path}: weight(s) {repeated[:8]} also appear in another shard of {source}")
            weights.update(part)
        weights = {k: v for k, v in weights.items() if not k.endswith(_DERIVED_BUFFER_SUFFIX)}
        return weights, source
    raise CheckpointError(f"{folder}: no weights found; expected model.safetensors, model.safetensors.index.json, "
                          f"pytorch_model.bin or pytorch_model.bin.index.json")


def _shards_from_index(index: Path) -> list[Path]:
    weight_map = _read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index}: expected a non-empty 'weight_map' of weight name -> shard file")
    files = [index.parent / name for name in sorted(set(weight_map.values()))]
    absent = [str(f.name) for f in files if not f.is_file()]
    if absent:
        raise CheckpointError(f"{index}: shard file(s) {absent} listed in weight_map are missing from "
                              f"{index.parent}")
    return files


def _load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError, safe_open
    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{path}: cannot read as safetensors: {e}") from e


def _load_bin(path: Path) -> dict[str, torch.Tensor]:
    try:
        weights = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # torch raises RuntimeError / UnpicklingError / others for unreadable files
        raise CheckpointError(f"{path}: cannot read as a torch state dict (weights_only, mmap): {e}") from e
    if not isinstance(weights, dict):
        raise CheckpointError(f"{path}: holds a {type(weights).__name__}, expected a dict of name -> tensor")
    not_tensors = sorted(k for k, v in weights.items() if not isinstance(v, torch.Tensor))
    if not_tensors:
        raise CheckpointError(f"{path}: entries {not_tensors[:8]} are not tensors")
    return weights


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise CheckpointError(f"{path}: not found; an HF LlamaForCausalLM folder needs it")
    return read_json_object(path, CheckpointError)
