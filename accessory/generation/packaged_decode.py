"""Compile once, run many: the CPU engine's compiled decode step from AOTInductor packages in the cache, so that a
process loads the step a previous one compiled instead of compiling it again.

`$ACCESSORY_CACHE/compiled/<key>/rows-<fewest>-<most>.pt2` is one package (decode_export.py) for a range of rows;
the key (package_key.py) is what its code depends on. A call with rows no package there covers exports and compiles
one (tens of seconds), written atomically, then loaded; later calls and later processes load it (well under a
second). A package is code, so it is loaded only from folders `untrusted` accepts. One that does not load (a
corrupt file) is reported and compiled again. What cannot be packaged falls back to torch.compile
(model_runner.compiled), with one line saying why: a mixture of experts (its dispatch, accessory::grouped_experts,
is a Python operator), more than one rank (packages are made at one rank only), a cache that is not private, or
an export or compilation that fails.
"""
from __future__ import annotations

import logging
import os
import re
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

import torch

from accessory.cache_dir import cache_dir, cache_folder, untrusted
from accessory.errors import ConfigError
from accessory.generation import decode_export
from accessory.generation.model_runner import MIN_COLUMNS, compiled
from accessory.generation.package_key import model_key, package_key
from accessory.network.components import MoEFeedForward, decode_mask

log = logging.getLogger(__name__)
PACKAGE_NAME = re.compile(r"rows-(\d+)-(\d+|up)\.pt2")


def compiled_decode(model) -> Callable:
    """The engine's decode step with compile=True: on the CPU, from packages; on CUDA, torch.compile's graphs
    (model_runner.compiled)."""
    if model.device.type != "cpu":
        return compiled(model.decode, model.device)
    return PackagedDecode(model)


class PackagedDecode:
    """step(tokens, positions, mask) -> logits, as `Transformer.decode`, from the package covering the call's rows.
    `builds` and `loads` count the packages this process compiled and loaded."""

    def __init__(self, model):
        self.model = model
        self.builds = self.loads = 0
        self.fallback: Optional[Callable] = None
        self.reason = ""  # why the fallback runs
        self.model_key = None
        self.steps: dict[str, list[tuple[int, Optional[int], Callable]]] = {}  # key -> (fewest, most, step)
        reason = why_not_packaged(model)
        if reason is not None:
            self.use_fallback(reason, logging.INFO)
        else:
            self.model_key = model_key(model)

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if self.fallback is None:
            step = self.step_for(tokens, positions, mask)
            if step is not None:
                return step(tokens, positions, mask, decode_export.cache_inputs(self.model))
        return self.fallback(tokens, positions, mask)

    def use_fallback(self, reason: str, level: int = logging.WARNING) -> None:
        self.reason = reason
        log.log(level, "the decode step is compiled with torch.compile, not packaged: %s", reason)
        self.fallback = compiled(self.model.decode, self.model.device)

    @property
    def key(self) -> str:
        """The key of the model with its KV caches as they are now."""
        rings = tuple(cache.ring for cache in decode_export.layer_caches(self.model))
        return package_key(self.model_key, rings)

    def prepare(self, most_rows: int) -> list[Path]:
        """Compile (or find) the packages covering 1..most_rows rows ahead of time (`accessory compile`), at the
        narrowest KV-cache width; their paths. A ConfigError if this model's step cannot be packaged."""
        if self.fallback is not None:
            raise ConfigError(f"the decode step cannot be packaged: {self.reason}")
        columns = min(MIN_COLUMNS, self.model.args.max_seq_len)
        self.model.setup_caches(max(most_rows, 2), columns)
        try:
            rows, paths = 1, []
            while rows <= most_rows:
                # token 0 at position 0, in two tensors: export takes one tensor passed twice for one input
                tokens, positions = (torch.zeros(rows, dtype=torch.long, device=self.model.device) for _ in "tp")
                with torch.inference_mode():
                    self(tokens, positions, decode_mask(positions, columns))
                if self.fallback is not None:
                    raise ConfigError(f"the decode step cannot be packaged: {self.reason}")
                fewest, most, _ = self.loaded_step(self.key, rows)
                paths.append(cache_dir() / "compiled" / self.key / package_name(fewest, most))
                rows = most_rows + 1 if most is None else most + 1
        finally:
            self.model.free_caches()
        return paths

    def step_for(self, tokens, positions, mask) -> Optional[Callable]:
        """The loaded step covering tokens' rows: already loaded, loaded from the cache, or compiled now; None if
        packaging failed (the fallback is then set)."""
        key, rows = self.key, tokens.shape[0]
        loaded = self.loaded_step(key, rows)
        if loaded is not None:
            return loaded[2]
        try:
            folder = cache_folder("compiled", key)
            doubt = untrusted(folder, cache_dir() / "compiled")
        except OSError as e:
            folder, doubt = None, f"the cache cannot be used ({e})"
        if doubt is not None:
            self.use_fallback(f"packages are code, and {doubt}")
            return None
        return self.load_cached(folder, rows) or self.build(folder, tokens, positions, mask)

    def load_cached(self, folder: Path, rows: int) -> Optional[Callable]:
        """The step from a package in `folder` covering `rows`, if one is there and loads; a package that does not
        load is reported and removed (then compiled again)."""
        for path in sorted(folder.glob("rows-*.pt2")):
            fewest, most = package_rows(path)
            if fewest is None or not covers(fewest, most, rows):
                continue
            doubt = untrusted(path, cache_dir() / "compiled")
            if doubt is not None:
                log.warning("not loading the compiled decode step %s: %s; compiling it again", path, doubt)
                path.unlink(missing_ok=True)
                return None
            try:
                step = decode_export.load(path, self.model)
            except Exception as e:  # a corrupt or truncated package: any error the loader raises
                log.warning("the compiled decode step %s does not load (%s: %s); compiling it again", path,
                            type(e).__name__, str(e)[:300])
                path.unlink(missing_ok=True)
                return None
            self.loads += 1
            log.info("loaded the compiled decode step for rows %s from %s", _rows_text(fewest, most), path)
            return self.keep(folder.name, fewest, most, step)
        return None

    def build(self, folder: Path, tokens, positions, mask) -> Optional[Callable]:
        """Export and compile the step for tokens' rows into a package in `folder` (atomically), and load it."""
        start = time.perf_counter()
        try:
            program = decode_export.export_decode(self.model, tokens, positions, mask)
            fewest, most = decode_export.rows_range(program)
            target = folder / package_name(fewest, most)
            with tempfile.TemporaryDirectory(dir=folder) as work:
                package = decode_export.compile_package(program, Path(work) / target.name)
                package.chmod(0o600)  # writable by no one else whatever the umask, or no process would load it
                os.replace(package, target)
            step = decode_export.load(target, self.model)
        except Exception as e:  # export and inductor raise many kinds; torch.compile may still do it
            self.use_fallback(f"packaging it failed ({type(e).__name__}: {str(e)[:300]})")
            return None
        self.builds += 1
        log.info("compiled the decode step for rows %s into %s in %.1f s (key %s)", _rows_text(fewest, most),
                 target, time.perf_counter() - start, folder.name)
        return self.keep(folder.name, fewest, most, step)

    def loaded_step(self, key: str, rows: int) -> Optional[tuple[int, Optional[int], Callable]]:
        """(fewest, most, step) of the loaded package of `key` covering `rows`, or None."""
        return next((entry for entry in self.steps.get(key, []) if covers(entry[0], entry[1], rows)), None)

    def keep(self, key: str, fewest: int, most: Optional[int], step: Callable) -> Callable:
        self.steps.setdefault(key, []).append((fewest, most, step))
        return step


def why_not_packaged(model) -> Optional[str]:
    """Why the model's decode step cannot be packaged here, or None."""
    if model.ctx.world_size > 1:
        return f"packages are made at one rank, and this model runs on {model.ctx.world_size}"
    if any(isinstance(module, MoEFeedForward) for module in model.modules()):
        return "a mixture of experts' dispatch (accessory::grouped_experts) is a Python operator, which an " \
               "AOTInductor package cannot call"
    return None


def package_rows(path: Path) -> tuple[Optional[int], Optional[int]]:
    """(fewest, most) rows of the package at `path`, from its name (most None: no bound); (None, None) for a
    name no package has."""
    match = PACKAGE_NAME.fullmatch(path.name)
    if match is None:
        return None, None
    return int(match[1]), None if match[2] == "up" else int(match[2])


def covers(fewest: int, most: Optional[int], rows: int) -> bool:
    return fewest <= rows and (most is None or rows <= most)


def package_name(fewest: int, most: Optional[int]) -> str:
    return f"rows-{fewest}-{'up' if most is None else most}.pt2"


def _rows_text(fewest: int, most: Optional[int]) -> str:
    return str(fewest) if fewest == most else f"{fewest}..{'' if most is None else most}"

