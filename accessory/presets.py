"""The presets of the top-level `configs/` folder: model configs (`model/*.json`) and LLaMA2-Accessory's PEFT configs
(`peft/*.json`) for `--llama_config`, serving flags (`serve/*.yaml`) for `--config`.

One folder, found in one of two places: `accessory/configs/` in an installed package (setup.py installs the
top-level folder there), else `configs/` beside the `accessory/` package of a source checkout.

A value that names an existing file is that file. Otherwise it is a preset name: the preset's path under configs/
without its suffix (`model/llama2-7b`, `serve/throughput`), or its file name without the suffix (`llama2-7b`,
`throughput`); the suffix may be written too. Anything else is an error that lists the presets.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from accessory.errors import ConfigError

PACKAGE = Path(__file__).resolve().parent
MODEL_SUFFIXES = (".json",)  # --llama_config
FLAG_SUFFIXES = (".yaml", ".yml")  # --config


def presets_folder() -> Path:
    """The installed copy, else the source checkout's folder."""
    for folder in (PACKAGE / "configs", PACKAGE.parent / "configs"):
        if folder.is_dir():
            return folder
    raise ConfigError(f"no configs/ folder in {PACKAGE} nor beside it: this installation of accessory is incomplete "
                      f"(reinstall it with pip install .)")


def preset_files(suffixes: Sequence[str]) -> list[Path]:
    """Every preset with one of `suffixes`, sorted by its path under configs/."""
    root = presets_folder()
    return sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in suffixes)


def preset_names(suffixes: Sequence[str]) -> list[str]:
    """The short names (file names without the suffix) of the presets with one of `suffixes`."""
    return [p.stem for p in preset_files(suffixes)]


def resolve(value: str | Path, suffixes: Sequence[str], flag: str) -> Path:
    """The file `value` names: itself when it is a file, else the preset it names (see the module's docstring)."""
    if Path(value).is_file():
        return Path(value)
    root, name = presets_folder(), str(value)
    for suffix in suffixes:
        name = name.removesuffix(suffix)
    found = [p for p in preset_files(suffixes)
             if name in (p.stem, p.relative_to(root).with_suffix("").as_posix())]
    if len(found) == 1:
        return found[0]
    if found:
        raise ConfigError(f"{flag} {value!r} names {len(found)} presets: "
                          f"{[p.relative_to(root).with_suffix('').as_posix() for p in found]}; give one of them")
    raise ConfigError(f"{flag} {value!r} is neither a file nor a preset; presets: "
                      f"{', '.join(preset_names(suffixes))} (in {root})")
