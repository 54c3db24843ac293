"""Hugging Face folders <-> canonical form: `read_hf` imports a `LlamaForCausalLM`, or another family's folder
(`Qwen2ForCausalLM`, `Qwen3ForCausalLM`, `MistralForCausalLM`, `Gemma3ForCausalLM`, `Gemma3ForConditionalGeneration`'s
language model: families.py), `write_hf` exports LLaMA.

Both directions use one name table (`HF_TO_META`, read forwards or backwards, with a family's additions), one config
mapping pair (`config_from_hf` / `config_to_hf`) and the q/k permutation pair: HF's q_proj / k_proj rows are in the
rotate-half RoPE layout, Meta's (ours) interleave each head's rotary pairs. HF's convert script applies
`meta_to_hf_qk`; we apply its inverse on import (to q/k rows, biases and norm weights alike) and it on export.
"""
from __future__ import annotations

import json
import logging
import math
import shutil
from collections.abc import Mapping
from functools import partial
from pathlib import Path
from typing import Callable, Optional

import torch
from tqdm import tqdm

from accessory.checkpoint.importers.common import (ImportedModel, LazyTensors, check_shapes, expand_templates,
                                                   rename_strict, shapes_of, validated_args)
from accessory.checkpoint.importers.families import (Family, hf_family, qk_tensors, with_family_names,
                                                      without_dense_mlp)
from accessory.errors import CheckpointError, ConfigError
from accessory.network.config import LLAMA3_ROPE_DEFAULTS
from accessory.network.config import FIELD_RANGES, MOE_KEYS
from accessory.untrusted import decoded, integer, json_object, named_inside, number, read_json_object, shown

log = logging.getLogger(__name__)

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

HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "generation_config.json", "chat_template.jinja")


def meta_to_hf_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Meta's interleaved q/k rows -> HF's rotate-half rows (pass n_kv_heads for k), as HF's convert script does.
    A 1-D tensor (a bias, a q/k norm weight) is permuted as a column."""
    rows, cols = w.shape[0], w[0].numel()
    # (n_heads, head_dim/2, 2, cols): pair p of head h holds rows 2p, 2p+1 -> (n_heads, 2, head_dim/2, cols)
    return w.reshape(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(w.shape)


def hf_to_meta_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """HF's rotate-half q/k rows -> Meta's interleaved rows (pass n_kv_heads for k); inverse of `meta_to_hf_qk`."""
    rows, cols = w.shape[0], w[0].numel()
    # (n_heads, 2, head_dim/2, cols): halves of head h -> (n_heads, head_dim/2, 2, cols), pairs adjacent
    return w.reshape(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(w.shape)


def read_hf_config(folder: Path) -> dict:
    """The folder's config.json: CheckpointError if it is missing, ConfigError naming it if it is not a JSON object
    (or too large, or nested too deep)."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{path}: not found; an HF model folder needs it")
    return read_json_object(path, ConfigError)


def read_causal_lm(folder: Path, hf: dict) -> ImportedModel:
    """Read an HF folder (config.json `hf` plus model.safetensors, sharded safetensors with
    model.safetensors.index.json, or pytorch_model.bin, sharded or not) of a known family into canonical names, q/k
    permuted back to Meta's layout, tensors in their stored dtype. Raises CheckpointError / ConfigError naming the
    file and key."""
    folder = Path(folder)
    config_path = folder / "config.json"
    family = hf_family(hf, str(config_path))
    config = config_from_hf(hf, str(config_path))
    validated_args(config, source=str(config_path), llama_type=family.llama_type)  # before reading any weight
    weights, source = load_weights(folder)
    if "text_config" in hf:  # Gemma3ForConditionalGeneration: its language model
        weights = _language_model_weights(weights, source)
    state_dict = language_model(weights, config, source, str(config_path), family)
    tokenizer_files = [folder / name for name in HF_TOKENIZER_FILES if (folder / name).is_file()]
    return ImportedModel(state_dict=state_dict, config=config, tokenizer_files=tokenizer_files,
                         llama_type=family.llama_type)


# The language model's weights in a vision-language folder, by the prefix transformers 4 or 5 saved them under.
_LANGUAGE_MODEL_PREFIXES = {"language_model.model.": "model.", "model.language_model.": "model.",
                            "language_model.lm_head.": "lm_head.", "lm_head.": "lm_head."}
_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


def _language_model_weights(weights: dict[str, torch.Tensor], source: str) -> dict[str, torch.Tensor]:
    """The language model's weights of a vision-language folder under its CausalLM names; the vision tower and
    projector are left out (this family's text model is what is imported)."""
    out = {}
    for name, tensor in weights.items():
        if name.startswith(_VISION_PREFIXES):
            continue
        prefix = next((p for p in _LANGUAGE_MODEL_PREFIXES if name.startswith(p)), None)
        if prefix is None:
            raise CheckpointError(f"{source}: weight {name} belongs to neither the language model nor the vision "
                                  f"tower")
        out[_LANGUAGE_MODEL_PREFIXES[prefix] + name[len(prefix):]] = tensor
    return out


def language_model(weights: dict[str, torch.Tensor], config: dict, source: str, config_source: str,
                   family: Optional[Family] = None) -> dict[str, torch.Tensor]:
    """A CausalLM's weights (HF names) in canonical names, checked against `config`, q/k permuted back to Meta's
    layout. `family`: LLaMA's names unless given."""
    llama_type = family.llama_type if family else "llama"
    args = validated_args(config, source=config_source, llama_type=llama_type)
    base, experts = HF_TO_META, args.experts.num_experts if args.experts else 0
    if family and family.hf_experts:  # a mixture of experts instead of the dense MLP
        base = without_dense_mlp(HF_TO_META)
        weights = unfused_experts(weights, family.hf_fused, args.n_layers, experts, source)
    table = with_family_names(base, {**family.hf_names, **family.hf_experts} if family else {})
    names = expand_templates(table, args.n_layers, experts)
    state_dict = rename_strict(weights, names, source, optional=frozenset({"output.weight"}))
    if args.tie_word_embeddings:
        _drop_tied_output(state_dict, source)
    elif "output.weight" not in state_dict:
        raise CheckpointError(f"{source}: missing weight lm_head.weight, and {config_source} says "
                              f"tie_word_embeddings is false")
    check_shapes({name: tuple(t.shape) for name, t in state_dict.items()}, args, source, llama_type)
    rotate_half_to_interleaved(state_dict, args, hf_to_meta_qk)
    return state_dict


def unfused_experts(weights: dict[str, torch.Tensor], fused: dict, n_layers: int, n_experts: int,
                    source: str) -> dict[str, torch.Tensor]:
    """`weights` with the experts of a layer held fused (transformers 5's in-memory form: `experts.gate_up_proj`
    (E, 2 * hidden, dim) and `experts.down_proj` (E, dim, hidden)) split into the per-expert names save_pretrained
    writes (their rows, in order: gate then up), so both forms import; a fused router name is renamed likewise.
    The per-expert views share the fused tensors' storage (nothing is copied)."""
    out = dict(weights)
    for template, targets in fused.items():
        for i in range(n_layers):
            name = template.format(i=i)
            if name not in out:
                continue
            tensor = out.pop(name)
            if tensor.dim() == 2:  # the router: a rename
                out[targets[0].format(i=i)] = tensor
                continue
            if tensor.shape[0] != n_experts or tensor.shape[1] % len(targets):
                raise CheckpointError(f"{source}: {name} has shape {tuple(tensor.shape)}; expected ({n_experts} "
                                      f"experts, a multiple of {len(targets)} rows, inputs)")
            for e in range(n_experts):
                for target, rows in zip(targets, tensor[e].chunk(len(targets))):
                    out[target.format(i=i, e=e)] = rows
    return out


def rotate_half_to_interleaved(state_dict: dict, args, permute) -> None:
    """Apply `permute(tensor, heads)` (hf_to_meta_qk, or a row permutation of quantized parts) to every q/k tensor
    in the state dict: weights and biases by head, norm weights as one head."""
    heads = {"q": args.n_heads, "k": args.n_kv_heads, "norm": 1}
    for name, kind in qk_tensors(args.n_layers):
        if name in state_dict:
            state_dict[name] = permute(state_dict[name], heads[kind])


def config_from_hf(hf: dict, source: str) -> dict:
    """An HF config dict of a known family -> our config dict (its ModelArgs keys only). Missing optional keys take
    HF's defaults. A vision-language folder's `text_config` is its language model's. Every value read is checked
    before any arithmetic on it (`checked_hf_values`): a ConfigError names `source`, the key and the value."""
    family = hf_family(hf, source)
    hf = _text_model(hf, source)
    missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                           "vocab_size") if hf.get(k) is None]
    if missing:
        raise ConfigError(f"{source}: missing key(s) {missing} that a {family.hf_architectures[0]} config needs")
    hf = checked_hf_values(hf, source)
    _refuse_unsupported(hf, family, source)
    dim, n_heads = hf["hidden_size"], hf["num_attention_heads"]
    rope_theta, rope_scaling = _rope_from_hf(hf, source)
    config = {
        "dim": dim,
        "n_layers": hf["num_hidden_layers"],
        "n_heads": n_heads,
        "n_kv_heads": hf.get("num_key_value_heads") or n_heads,
        "vocab_size": hf["vocab_size"],
        "hidden_dim": hf["intermediate_size"],
        "norm_eps": hf.get("rms_norm_eps", 1e-6),
        "rope_theta": rope_theta,
        "rope_scaling": rope_scaling,
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", family.llama_type == "gemma3")),
        "max_seq_len": hf.get("max_position_embeddings", 2048),
    }
    if hf.get("head_dim") is not None and hf["head_dim"] != dim // n_heads:
        config["head_dim"] = hf["head_dim"]
    return {**config, **family.hf_config(hf, source)}


def _text_model(hf: dict, source: str) -> dict:
    """The language model's config: a vision-language config's `text_config`, else `hf` itself."""
    if "text_config" not in hf:
        return hf
    if not isinstance(hf["text_config"], dict):
        raise ConfigError(f"{source}: text_config must be an object (the language model's config), got "
                          f"{shown(hf['text_config'])}")
    return {**hf["text_config"], "architectures": hf.get("architectures")}


def _refuse_unsupported(hf: dict, family: Family, source: str) -> None:
    """ConfigError for what the family's model here lacks: biases it does not have, another activation."""
    if hf.get("mlp_bias"):
        raise ConfigError(f"{source}: mlp_bias is true; MLP layers with biases are not supported")
    if family.llama_type in ("llama", "mistral", "mixtral"):
        if hf.get("attention_bias"):
            raise ConfigError(f"{source}: attention_bias is true; LLaMA layers with biases are not supported")
    if family.llama_type != "gemma3" and hf.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{source}: hidden_act {shown(hf['hidden_act'])} is not supported; expected 'silu'")


# Each config.json number the importer reads, by its type and inclusive range (ModelArgs' own where it becomes one of
# its fields): checked before any arithmetic on it.
HF_NUMBERS = {
    "hidden_size": FIELD_RANGES["dim"], "num_hidden_layers": FIELD_RANGES["n_layers"],
    "num_attention_heads": FIELD_RANGES["n_heads"], "num_key_value_heads": FIELD_RANGES["n_kv_heads"],
    "intermediate_size": FIELD_RANGES["hidden_dim"], "vocab_size": (int, 1, 1 << 24),
    "rms_norm_eps": FIELD_RANGES["norm_eps"], "rope_theta": FIELD_RANGES["rope_theta"],
    "max_position_embeddings": FIELD_RANGES["max_seq_len"], "head_dim": FIELD_RANGES["head_dim"],
    "sliding_window": FIELD_RANGES["sliding_window"], "max_window_layers": (int, 0, 1 << 20),
    "sliding_window_pattern": (int, 1, 1 << 10), "_sliding_window_pattern": (int, 1, 1 << 10),
    "rope_local_base_freq": FIELD_RANGES["rope_local_theta"],
    "query_pre_attn_scalar": FIELD_RANGES["query_pre_attn_scalar"],
    "final_logit_softcapping": FIELD_RANGES["final_logit_softcapping"],
    "num_local_experts": MOE_KEYS["num_experts"], "num_experts": MOE_KEYS["num_experts"],
    "num_experts_per_tok": MOE_KEYS["num_experts_per_tok"], "moe_intermediate_size": FIELD_RANGES["hidden_dim"],
}
HF_FLAGS = ("tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window", "use_bidirectional_attention",
            "norm_topk_prob")
HF_OBJECTS = ("rope_scaling", "rope_parameters")


def checked_hf_values(hf: dict, source: str) -> dict:
    """`hf` with each number the importer reads (HF_NUMBERS) an int or a finite float in its range (an integral
    float becomes the int), each flag (HF_FLAGS) true or false, each nested object (HF_OBJECTS) a JSON object;
    ConfigError naming `source`, the key and the value otherwise. A null is left as it is (HF writes null for
    "not set")."""
    out = dict(hf)
    for key, (kind, low, high) in HF_NUMBERS.items():
        if out.get(key) is not None:
            out[key] = (integer if kind is int else number)(out[key], source, key, ConfigError, low, high)
    for key in HF_FLAGS:
        if out.get(key) is not None and not isinstance(out[key], bool):
            raise ConfigError(f"{source}: {key} must be true or false, got {shown(out[key])}")
    for key in HF_OBJECTS:
        if out.get(key) is not None and not isinstance(out[key], dict):
            raise ConfigError(f"{source}: {key} must be an object, got {shown(out[key])}")
    return out


# Keys of each rope type we support, as HF names them (and as our dict form keeps them), and those it may have.
_ROPE_KEYS = {"linear": ("factor",),
              "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
              "yarn": ("factor", "original_max_position_embeddings")}
_ROPE_OPTIONAL = {"yarn": ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate")}


def _rope_from_hf(hf: dict, source: str) -> tuple[float, Optional[dict]]:
    """(rope_theta, our rope_scaling) from transformers<5 `rope_theta` + `rope_scaling` or transformers 5
    `rope_parameters` (which holds rope_theta and the scaling together; per layer type for Gemma 3, whose global
    layers' are the model's)."""
    params = hf.get("rope_parameters") or {}
    if "full_attention" in params:
        params = hf_object(params["full_attention"], "rope_parameters.full_attention", source)
    theta = number(params.get("rope_theta", hf.get("rope_theta", 10000.0)), source, "rope_theta", ConfigError,
                   *FIELD_RANGES["rope_theta"][1:])
    scaling = params if params.get("rope_type", "default") != "default" else hf.get("rope_scaling")
    if not scaling:
        return theta, None
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if rope_type in (None, "default"):
        return theta, None
    if not isinstance(rope_type, str) or rope_type not in _ROPE_KEYS:
        raise ConfigError(f"{source}: rope scaling type {shown(rope_type)} is not supported; expected one of "
                          f"{sorted(_ROPE_KEYS)} or 'default'")
    missing = [k for k in _ROPE_KEYS[rope_type] if k not in scaling]
    if missing:
        raise ConfigError(f"{source}: {rope_type} rope scaling lacks key(s) {missing}")
    kept = _ROPE_KEYS[rope_type] + tuple(k for k in _ROPE_OPTIONAL.get(rope_type, ()) if scaling.get(k) is not None)
    return theta, {"rope_type": rope_type, **{k: scaling[k] for k in kept}}  # its values: ModelArgs checks them


def hf_object(value, key: str, source: str) -> dict:
    """`value`, a nested JSON object of config.json (null: empty); ConfigError naming the key otherwise."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"{source}: {key} must be an object, got {shown(value)}")
    return value


def _drop_tied_output(state_dict: dict, source: str) -> None:
    """Tied embeddings: an `lm_head.weight` that was saved anyway must equal the embeddings; drop it."""
    output = state_dict.pop("output.weight", None)
    if output is not None and not torch.equal(output, state_dict["tok_embeddings.weight"]):
        raise CheckpointError(f"{source}: tie_word_embeddings is true but lm_head.weight differs from "
                              f"model.embed_tokens.weight")


def load_weights(folder: Path) -> tuple[dict[str, torch.Tensor], str]:
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
    """The shard files an index names, each inside its folder (CheckpointError naming the index and the name)."""
    weight_map = _read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index}: expected a non-empty 'weight_map' of weight name -> shard file")
    files = sorted({named_inside(index.parent, name, f"{index}: weight_map", CheckpointError)
                    for name in weight_map.values()})
    absent = [str(f.name) for f in files if not f.is_file()]
    if absent:
        raise CheckpointError(f"{index}: shard file(s) {absent} listed in weight_map are missing from "
                              f"{index.parent}")
    return files


def _load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError, safe_open

    check_safetensors_header(path)
    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{path}: cannot read as safetensors: {e}") from e


SAFETENSORS_MAX_HEADER = 100 << 20  # the safetensors package's own limit


def check_safetensors_header(path: Path) -> None:
    """CheckpointError naming `path` unless it starts with an 8-byte little-endian header length that fits in the
    file (and in the package's limit), then that many bytes of a UTF-8 JSON object, before the safetensors package
    (which reads the header into memory) is handed the file."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise CheckpointError(f"{path}: {size} bytes; a safetensors file starts with an 8-byte header length")
        length = int.from_bytes(prefix, "little")
        if length > min(size - 8, SAFETENSORS_MAX_HEADER):
            raise CheckpointError(f"{path}: safetensors header length {length} exceeds the {size - 8} bytes after it "
                                  f"(or the {SAFETENSORS_MAX_HEADER}-byte limit)")
        header = decoded(f.read(length), f"{path}: safetensors header", CheckpointError)
    json_object(header, f"{path}: safetensors header", CheckpointError)


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


# ---- export ------------------------------------------------------------------------------------------------------

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def config_to_hf(config: dict, dtype: torch.dtype, bos_id: Optional[int] = None, eos_id: Optional[int] = None,
                 source: str = "config") -> dict:
    """Our config dict -> an HF LlamaConfig dict; `config_from_hf` of it gives the same model back."""
    args = validated_args(config, source)
    if args.vocab_size <= 0:
        raise ConfigError(f"{source}: vocab_size {args.vocab_size} must be resolved (from the tokenizer) first")
    hf = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": args.dim, "intermediate_size": args.ffn_hidden_dim, "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads, "num_key_value_heads": args.n_kv_heads, "head_dim": args.head_dim,
        "vocab_size": args.vocab_size, "rms_norm_eps": args.norm_eps, "rope_theta": args.rope_theta,
        "rope_scaling": _rope_to_hf(args), "max_position_embeddings": args.max_seq_len,
        "tie_word_embeddings": args.tie_word_embeddings, "attention_bias": False, "mlp_bias": False,
        "torch_dtype": DTYPE_NAMES[dtype],
    }
    hf.update({k: v for k, v in (("bos_token_id", bos_id), ("eos_token_id", eos_id)) if v is not None})
    return hf


def _rope_to_hf(args) -> Optional[dict]:
    """Our rope_scaling (None, LLaMA2-Accessory's float, a dict, or Meta's use_scaled_rope) in HF's form."""
    scaling = args.rope_scaling
    if scaling is None and args.use_scaled_rope:
        scaling = {"rope_type": "llama3"}
    if scaling is None:
        return None
    if isinstance(scaling, (int, float)):
        return {"rope_type": "linear", "factor": float(scaling)}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind not in ("linear", "llama3"):
        raise ConfigError(f"rope_scaling {scaling}: type {kind!r} has no HF form here; expected {sorted(_ROPE_KEYS)}")
    defaults = LLAMA3_ROPE_DEFAULTS if kind == "llama3" else {}  # HF's LlamaConfig needs every key spelled out
    return {"rope_type": kind, **{k: scaling.get(k, defaults.get(k)) for k in _ROPE_KEYS[kind]}}


def hf_state_dict(state_dict: Mapping[str, torch.Tensor], args, source: str) -> LazyTensors:
    """Canonical tensors -> HF names, q/k permuted to rotate-half, each read from `state_dict` when it is read
    itself (a LazyTensors source makes one tensor at a time); the inverse of `read_hf`'s renaming."""
    to_hf = {ours: theirs for theirs, ours in expand_templates(HF_TO_META, args.n_layers).items()}
    reads = rename_strict({name: partial(state_dict.__getitem__, name) for name in state_dict}, to_hf, source,
                          optional=frozenset({"lm_head.weight"}))
    shapes = shapes_of(state_dict)
    check_shapes(shapes, args, source)
    if args.tie_word_embeddings:
        reads.pop("lm_head.weight", None)  # HF ties it to embed_tokens when loading
    elif "lm_head.weight" not in reads:
        raise CheckpointError(f"{source}: missing output.weight, and tie_word_embeddings is false")
    for i in range(args.n_layers):
        for proj, heads in (("q", args.n_heads), ("k", args.n_kv_heads)):
            name = f"model.layers.{i}.self_attn.{proj}_proj.weight"
            reads[name] = partial(_to_rotate_half, reads[name], heads)
    return LazyTensors(reads, {to_hf[name]: shape for name, shape in shapes.items() if to_hf[name] in reads})


def _to_rotate_half(read: Callable[[], torch.Tensor], heads: int) -> torch.Tensor:
    return meta_to_hf_qk(read(), heads)


def write_hf(model: ImportedModel, dst, dtype: Optional[torch.dtype] = None, max_shard_bytes: int = 5 << 30,
             source: str = "checkpoint to export") -> Path:
    """Write a canonical model as a new HF folder that transformers loads with `LlamaForCausalLM.from_pretrained`
    and `AutoTokenizer.from_pretrained`: model.safetensors (sharded with an index past `max_shard_bytes`),
    config.json, generation_config.json and the tokenizer. Atomic; an existing `dst` is refused."""
    from accessory.checkpoint.save import atomic_folder

    if model.llama_type != "llama":
        raise CheckpointError(f"{source}: llama_type {model.llama_type!r} has no HF export here; only 'llama' "
                              f"(LlamaForCausalLM) does")
    args = validated_args(model.config, source=f"config of {source}")
    dtype = dtype or next(iter(model.state_dict.values())).dtype
    weights = hf_state_dict(model.state_dict, args, source)
    with atomic_folder(dst) as tmp:
        tokenizer = _write_tokenizer(model.tokenizer_files, tmp)
        bos, eos = (tokenizer.bos_id, tokenizer.eos_id) if tokenizer else (None, None)
        config = config_to_hf(model.config, dtype, bos, eos, source=f"config of {source}")
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        if tokenizer and not (tmp / "generation_config.json").is_file():
            generation = {k: v for k, v in (("bos_token_id", bos), ("eos_token_id", eos)) if v is not None}
            (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
        _write_safetensors(weights, tmp, dtype, max_shard_bytes, Path(dst).name)
    return Path(dst)


def _write_safetensors(weights: LazyTensors, folder: Path, dtype: torch.dtype, max_bytes: int, name: str) -> None:
    """Each tensor read once, as its file is written: one file's tensors in memory at a time."""
    from safetensors.torch import save_file

    groups, size = [[]], 0
    sizes = {n: math.prod(shape) * dtype.itemsize for n, shape in weights.shapes.items()}
    for n, nbytes in sizes.items():  # fill each file up to max_bytes, in the table's order
        if groups[-1] and size + nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(n)
        size += nbytes
    names = (["model.safetensors"] if len(groups) == 1 else
             [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))])
    for file, group in tqdm(list(zip(names, groups)), desc=f"writing {name}", unit="file", leave=False):
        # clone: safetensors refuses tensors that share storage, which views of one memory-mapped file may do
        save_file({n: weights[n].to(dtype).contiguous().clone() for n in group}, str(folder / file),
                  metadata={"format": "pt"})  # transformers refuses safetensors without this metadata
    if len(groups) > 1:
        index = {"metadata": {"total_size": sum(sizes.values())},
                 "weight_map": {n: file for file, group in zip(names, groups) for n in group}}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _write_tokenizer(files: list[Path], folder: Path):
    """Copy the tokenizer and its side files, and add what transformers needs to load it: a tokenizer_config.json
    if there is none, and for a SentencePiece tokenizer.model alone a tokenizer.json (transformers 5 reads a
    tokenizer.model only with protobuf installed). The tokenizer as our runtime reads it, or None (with a warning)
    when the model has none."""
    from accessory.text.tokenizer import Tokenizer, find_tokenizer

    for path in files:
        shutil.copyfile(path, folder / Path(path).name)
    path = find_tokenizer([folder])
    if path is None:
        log.warning("no tokenizer.model / tokenizer.json to export: %s gets weights and config only", folder)
        return None
    tokenizer = Tokenizer.from_path(path)
    special = _special_tokens(tokenizer, path)
    if not (folder / "tokenizer_config.json").is_file():
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False, **special}
        if path.suffix == ".model":  # LLaMA's: BOS always, never EOS, as our runtime and Meta's code encode
            config.update(tokenizer_class="LlamaTokenizer", add_bos_token=tokenizer.bos_id is not None,
                          add_eos_token=False)
        (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    if path.suffix == ".model":
        _sentencepiece_to_json(path, folder / "tokenizer.json", special)
    return tokenizer


def _special_tokens(tokenizer, path: Path) -> dict:
    """bos_token / eos_token (and unk_token) by text, as tokenizer_config.json names them."""
    if path.suffix == ".model":
        import sentencepiece

        sp = sentencepiece.SentencePieceProcessor(model_file=str(path))
        token, unk = sp.id_to_piece, sp.unk_id()
    else:
        import tokenizers

        token, unk = tokenizers.Tokenizer.from_file(str(path)).id_to_token, -1
    ids = {"bos_token": tokenizer.bos_id, "eos_token": tokenizer.eos_id, "unk_token": unk if unk >= 0 else None}
    return {name: token(i) for name, i in ids.items() if i is not None}


def _sentencepiece_to_json(model: Path, target: Path, special: dict) -> None:
    """tokenizer.json for a LLaMA SentencePiece BPE model, built the way transformers builds it from the model
    (vocab in id order, merges ranked by piece score), so that AutoTokenizer loads the folder without protobuf.
    As with any HF LLaMA tokenizer, runs of leading spaces may split differently from SentencePiece itself."""
    import sentencepiece
    from transformers import LlamaTokenizer
    from transformers.tokenization_utils_base import generate_merges

    sp = sentencepiece.SentencePieceProcessor(model_file=str(model))
    vocab = {sp.id_to_piece(i): i for i in range(sp.vocab_size())}
    scores = {sp.id_to_piece(i): sp.get_score(i) for i in range(sp.vocab_size())}
    hf = LlamaTokenizer(vocab=vocab, merges=generate_merges(vocab, scores), add_bos_token="bos_token" in special,
                        add_eos_token=False, **special)
    hf.backend_tokenizer.save(str(target))
