"""HF LLaVA folders (`LlavaForConditionalGeneration`: vision tower, multi-modal projector, language model) ->
canonical form, llama_type "llava" (network/LLM/llava.py).

Three layouts of names are read, as transformers has saved them over the years: `vision_tower.vision_model.*`,
`multi_modal_projector.*`, `language_model.model.*` and `language_model.lm_head.weight` (llava-1.5-*-hf on the Hub);
the same without `vision_model.` (transformers 5's save_pretrained); and transformers 5's in-memory form
`model.vision_tower.*`, `model.multi_modal_projector.*`, `model.language_model.*`, `lm_head.weight`. The language
model goes through the LlamaForCausalLM import (hf.py); the tower and the projector keep HF's names.
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch

from accessory.checkpoint.importers.common import ImportedModel
from accessory.checkpoint.importers.hf import HF_TOKENIZER_FILES, config_from_hf, language_model, load_weights
from accessory.errors import CheckpointError, ConfigError
from accessory.untrusted import integer, number, read_json_object, shown
from accessory.network.vision import TOWER_KEYS

log = logging.getLogger(__name__)


def read_llava(folder: Path, hf: dict) -> ImportedModel:
    """Read an HF LLaVA folder whose config.json is `hf`; CheckpointError / ConfigError naming the file and key."""
    config_path = folder / "config.json"
    config = llava_config(hf, str(config_path), folder / "preprocessor_config.json")
    args = _args(config, str(config_path))
    weights, source = load_weights(folder)
    parts = _split(weights, source)
    state_dict = language_model(parts["language_model"], _text_only(config), source, str(config_path))
    model = _meta_model(args)
    for prefix in ("vision_tower", "multi_modal_projector"):
        checked = _checked(parts[prefix], model.get_submodule(prefix), prefix, source)
        state_dict.update({f"{prefix}.{name}": t for name, t in checked.items()})
    files = [folder / name for name in HF_TOKENIZER_FILES if (folder / name).is_file()]
    return ImportedModel(state_dict=state_dict, config=config, tokenizer_files=files, llama_type="llava")


def llava_config(hf: dict, source: str, preprocessor: Path) -> dict:
    """Our llava config from an HF LlavaConfig dict (missing keys take transformers' defaults, as the Hub's
    llava-1.5 configs rely on) and the image processor's normalisation."""
    architectures = hf.get("architectures")
    if architectures is not None and architectures != ["LlavaForConditionalGeneration"]:
        raise CheckpointError(f"{source}: architectures is {shown(architectures)}; a LLaVA folder that can be "
                              f"imported is ['LlavaForConditionalGeneration'] (LLaVA-NeXT and others are not "
                              f"supported)")
    full = _full_llava_config(hf, source)
    vision = full["vision_config"]
    config = {
        **config_from_hf(full["text_config"], f"{source}: text_config"),
        "vision": {key: vision[key] for key in TOWER_KEYS if key in vision},
        "vision_feature_layer": full["vision_feature_layer"],
        "vision_feature_select_strategy": full["vision_feature_select_strategy"],
        "projector_hidden_act": full["projector_hidden_act"],
        "projector_bias": full.get("multimodal_projector_bias", True),
        "image_token_index": full.get("image_token_index", full.get("image_token_id")),
    }
    if preprocessor.is_file():
        config.update(_normalisation(read_json_object(preprocessor, ConfigError), str(preprocessor)))
    return config


def _full_llava_config(hf: dict, source: str) -> dict:
    """`hf` with transformers' LlavaConfig defaults filled in; its two nested configs checked to be objects first."""
    from transformers import LlavaConfig

    for key in ("text_config", "vision_config"):
        if hf.get(key) is not None and not isinstance(hf[key], dict):
            raise ConfigError(f"{source}: {key} must be an object, got {shown(hf[key])}")
    for key in ("image_token_index", "image_token_id"):
        if hf.get(key) is not None:
            integer(hf[key], source, key, ConfigError, 0)
    try:
        return LlavaConfig(**{k: v for k, v in hf.items() if k != "architectures"}).to_dict()
    except Exception as e:  # transformers raises many kinds for odd values; any of them means an unreadable config
        raise ConfigError(f"{source}: not a readable LlavaConfig: {str(e)[:200]}") from e


def _normalisation(processor: dict, source: str) -> dict:
    """image_mean / image_std of preprocessor_config.json, each a list of finite numbers (their count and signs are
    the model config's to check)."""
    out = {}
    for key in ("image_mean", "image_std"):
        if key in processor:
            values = processor[key]
            if not isinstance(values, list) or len(values) > 16:
                raise ConfigError(f"{source}: {key} must be a list of numbers, one per channel, got {shown(values)}")
            out[key] = [number(v, source, key, ConfigError) for v in values]
    return out


def _args(config: dict, source: str):
    from accessory.network.LLM.llava import ModelArgs

    try:
        return ModelArgs.from_dict(config, source=source)
    except ConfigError as e:
        raise e if str(e).startswith(source) else ConfigError(f"{source}: {e}") from e


def _text_only(config: dict) -> dict:
    from accessory.network.config import ModelArgs

    keys = set(ModelArgs.__dataclass_fields__)
    return {k: v for k, v in config.items() if k in keys}


def _meta_model(args):
    from accessory.network.LLM.llava import Transformer
    from accessory.parallel import ParallelContext

    with torch.device("meta"):
        return Transformer(args, ParallelContext(None, 0, 1, 0))


def _split(weights: dict[str, torch.Tensor], source: str) -> dict[str, dict[str, torch.Tensor]]:
    """The weights by part, each under its own names: the language model's as LlamaForCausalLM names them."""
    parts = {"vision_tower": {}, "multi_modal_projector": {}, "language_model": {}}
    unknown = []
    for name, tensor in weights.items():
        if name.startswith(("model.vision_tower.", "model.multi_modal_projector.", "model.language_model.")):
            name = name[len("model."):]
        part, _, rest = name.partition(".")
        if part == "vision_tower":
            rest = rest.removeprefix("vision_model.")
            if rest.startswith("head."):  # SigLIP's pooling head: LLaVA reads hidden states, never it
                continue
        elif part == "language_model":
            rest = rest if rest.startswith(("model.", "lm_head.")) else "model." + rest
        elif name == "lm_head.weight":
            part, rest = "language_model", name
        if part not in parts:
            unknown.append(name)
            continue
        parts[part][rest] = tensor
    if unknown:
        raise CheckpointError(f"{source}: weight(s) {unknown[:8]} belong to no part of a LLaVA model (vision_tower, "
                              f"multi_modal_projector, language_model)")
    return parts


def _checked(weights: dict[str, torch.Tensor], module, prefix: str, source: str) -> dict[str, torch.Tensor]:
    """`weights` of `module` (built from the config on the meta device): exactly its names, in its shapes."""
    expected = {name: tuple(t.shape) for name, t in module.state_dict().items()}
    missing, unexpected = sorted(set(expected) - set(weights)), sorted(set(weights) - set(expected))
    if missing or unexpected:
        raise CheckpointError(f"{source}: {prefix} weights do not match its config: missing {missing[:8]}, "
                              f"unexpected {unexpected[:8]}")
    wrong = [f"{name}: {tuple(t.shape)}, expected {expected[name]}" for name, t in weights.items()
             if tuple(t.shape) != expected[name]]
    if wrong:
        raise CheckpointError(f"{source}: {prefix} tensor shape(s) disagree with config.json's vision_config: "
                              f"{wrong[:8]}")
    return weights
