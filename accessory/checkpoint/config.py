"""What a checkpoint folder says about its model, read and validated before any weight is touched.

Per folder, in order: `meta.json` (llama_type), Meta's `params.json`, `config.json`; then the explicit
`llama_config` files. Later files override earlier ones, and later folders override earlier folders.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from accessory.errors import ConfigError
from accessory.jsonfile import read_json_object

log = logging.getLogger(__name__)

CONFIG_FILES = ("params.json", "config.json")
META_KEYS = {"llama_type"}


@dataclass
class CheckpointSpec:
    folders: list[Path]
    llama_type: str
    config: dict  # merged model config values (keys of the llama_type's ModelArgs)


def read_spec(folders: Sequence[Path], llama_type: Optional[str] = None,
              llama_config: Sequence[str] = ()) -> CheckpointSpec:
    """Merge meta.json / params.json / config.json of every folder, then `llama_config`; check every key."""
    from accessory.model.LLM import model_classes

    found_type, config_files = None, []
    for folder in folders:
        meta_path = folder / "meta.json"
        if meta_path.is_file():
            meta = read_json_object(meta_path, ConfigError)
            if unknown := sorted(set(meta) - META_KEYS):
                raise ConfigError(f"{meta_path}: unknown key(s) {unknown}; meta.json holds {sorted(META_KEYS)}")
            found_type = meta.get("llama_type", found_type)
        config_files += [folder / name for name in CONFIG_FILES if (folder / name).is_file()]
    config_files += [Path(p) for p in llama_config]

    llama_type = llama_type or found_type or "llama"
    source = "llama_type argument" if llama_type != found_type else f"{folders[-1] / 'meta.json'}"
    model_args, _ = model_classes(llama_type, source=source)
    config = {}
    for path in config_files:
        values = read_json_object(path, ConfigError)
        model_args.check_keys(values, str(path))
        config.update(values)
    log.info("llama_type %s, config from %s", llama_type, [str(p) for p in config_files])
    return CheckpointSpec(list(folders), llama_type, config)


def resolved_config(config: dict, tokenizer, source: str) -> dict:
    """The config with vocab_size -1 (Meta's LLaMA-2 params.json) taken from `tokenizer` (a Tokenizer, or None if
    there is none), as every reader of a checkpoint must do before building the model."""
    if config.get("vocab_size", -1) > 0:
        return dict(config)
    if tokenizer is None:
        raise ConfigError(f"{source}: vocab_size is {config.get('vocab_size', -1)} (taken from the tokenizer) but "
                          f"there is no tokenizer.model / tokenizer.json; pass one (--tokenizer_path)")
    return {**config, "vocab_size": tokenizer.n_words}

