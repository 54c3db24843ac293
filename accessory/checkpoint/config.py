"""What a checkpoint folder says about its model, read and validated before any weight is touched.

Per folder, in order: `meta.json` (llama_type), Meta's `params.json`, `config.json`; then the explicit
`llama_config` files or presets (`llama2-7b`, `llamaPeft_normBiasLora`: accessory/presets.py). Later files override
earlier ones, and later folders override earlier folders.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from accessory.errors import CheckpointError, ConfigError
from accessory.untrusted import read_json_object
from accessory.presets import MODEL_SUFFIXES, resolve
from accessory.quant.formats import FORMATS, GROUP

log = logging.getLogger(__name__)

CONFIG_FILES = ("params.json", "config.json")
META_KEYS = {"llama_type", "quantization"}


@dataclass(frozen=True)
class Quantization:
    """meta.json's "quantization": which weights a checkpoint holds quantized, and how (quant/formats.py).

        {"quant": "int4", "group_size": 32, "tensors": {"layers.0.attention.wq.weight": "int4", ...}}

    `quant` names the checkpoint's kind (the format of its block linears, or "mixed"); `tensors` maps each quantized
    weight to its format (quant/formats.py FORMATS: int8 and int4, and the import-only GGUF block formats q4_k, q5_k,
    q6_k, q5_0); each is saved as its parts, `NAME.q`, `NAME.scale` and (int4) `NAME.min` (a GGUF block format: `NAME.q`
    alone). `group_size` is int8 / int4's group; a GGUF block format's block is fixed by its name."""
    quant: str
    tensors: dict[str, str]
    group_size: int = GROUP

    @classmethod
    def from_json(cls, value, source: str) -> "Quantization":
        names = " | ".join(f'"{f}"' for f in FORMATS)
        expected = f'{{"quant": {names} | "mixed", "group_size": 32, "tensors": {{name: {names}}}}}'
        if not isinstance(value, dict) or set(value) != {"quant", "group_size", "tensors"}:
            raise ConfigError(f"{source}: \"quantization\" must be {expected}, got {value!r}")
        if value["group_size"] != GROUP:
            raise ConfigError(f"{source}: quantization group_size {value['group_size']!r} is not supported; "
                              f"this version reads groups of {GROUP}")
        tensors = value["tensors"]
        if not isinstance(tensors, dict) or not tensors or any(f not in FORMATS for f in tensors.values()):
            raise ConfigError(f"{source}: quantization \"tensors\" must map weight names to one of {list(FORMATS)}")
        if value["quant"] not in (*FORMATS, "mixed"):
            raise ConfigError(f"{source}: quantization \"quant\" must be one of {[*FORMATS, 'mixed']}, got "
                              f"{value['quant']!r}")
        return cls(value["quant"], dict(tensors), value["group_size"])

    @classmethod
    def describe(cls, tensors: dict[str, str]) -> "Quantization":
        """The record for weights `tensors`: its kind is the format of the blocks' linears (all weights', if no
        block linear is quantized), or "mixed"."""
        kinds = {fmt for name, fmt in tensors.items() if name.startswith("layers.")} or set(tensors.values())
        return cls(kinds.pop() if len(kinds) == 1 else "mixed", dict(tensors))

    def to_json(self) -> dict:
        return {"quant": self.quant, "group_size": self.group_size, "tensors": self.tensors}


@dataclass
class CheckpointSpec:
    folders: list[Path]
    llama_type: str
    config: dict  # merged model config values (keys of the llama_type's ModelArgs)
    quantization: Optional[Quantization] = None  # the last folder's; None: float weights


def read_spec(folders: Sequence[Path], llama_type: Optional[str] = None,
              llama_config: Sequence[str] = ()) -> CheckpointSpec:
    """Merge meta.json / params.json / config.json of every folder, then `llama_config`; check every key."""
    from accessory.network.LLM import model_classes

    found_type, config_files, quantization = None, [], None
    for folder in folders:
        if not folder.is_dir():
            raise CheckpointError(f"checkpoint folder {folder} does not exist or is not a folder")
        meta_path = folder / "meta.json"
        quantization = None  # a later folder's weights replace the earlier ones': its own say counts
        if meta_path.is_file():
            meta = read_json_object(meta_path, ConfigError)
            if unknown := sorted(set(meta) - META_KEYS):
                raise ConfigError(f"{meta_path}: unknown key(s) {unknown}; meta.json holds {sorted(META_KEYS)}")
            found_type = meta.get("llama_type", found_type)
            if "quantization" in meta:
                quantization = Quantization.from_json(meta["quantization"], str(meta_path))
        config_files += [folder / name for name in CONFIG_FILES if (folder / name).is_file()]
    config_files += [resolve(p, MODEL_SUFFIXES, "llama_config") for p in llama_config]

    llama_type = llama_type or found_type or "llama"
    source = "llama_type argument" if llama_type != found_type else f"{folders[-1] / 'meta.json'}"
    model_args, _ = model_classes(llama_type, source=source)
    config = {}
    for path in config_files:
        values = read_json_object(path, ConfigError)
        model_args.check_keys(values, str(path))
        model_args.check_values(values, str(path))
        config.update(values)
    log.info("llama_type %s, config from %s", llama_type, [str(p) for p in config_files])
    return CheckpointSpec(list(folders), llama_type, config, quantization)


def resolved_config(config: dict, tokenizer, source: str) -> dict:
    """The config with vocab_size -1 (Meta's LLaMA-2 params.json) taken from `tokenizer` (a Tokenizer, or None if
    there is none), as every reader of a checkpoint must do before building the model."""
    if config.get("vocab_size", -1) > 0:
        return dict(config)
    if tokenizer is None:
        raise ConfigError(f"{source}: vocab_size is {config.get('vocab_size', -1)} (taken from the tokenizer) but "
                          f"there is no tokenizer.model / tokenizer.json; pass one (--tokenizer_path)")
    return {**config, "vocab_size": tokenizer.n_words}

