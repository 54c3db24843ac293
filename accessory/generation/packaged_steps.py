"""Compile once, run many: the CPU engine's compiled steps from AOTInductor packages in the cache, so that a process
loads the steps a previous one compiled instead of compiling them again.

`$ACCESSORY_CACHE/compiled/<key>/<step>-<size>-<fewest>-<most>.pt2` is one package (steps.py): the decode
step for a range of rows (`decode-rows-1-1.pt2`), or speculative decoding's verify step at one row for a range of
slots (`verify-slots-2-32.pt2`); the key (package_key.py) is what its code depends on. A call whose size no package
there covers exports and compiles one (tens of seconds), written atomically, then loaded; later calls and later
processes load it (well under a second). A package is code, so it is loaded only from folders `untrusted` accepts.
One that does not load (a corrupt file) is reported and compiled again. What cannot be packaged runs under
torch.compile (steps.compiled), with one line saying why: a mixture of experts (its dispatch,
accessory::grouped_experts, is a Python operator), ranks whose collectives go through gloo (a package compiles, but
its collectives fail when it runs, with torch 2.13: several rows' `_c10d_functional.wait_tensor` raises, one row's
step hangs; ranks of one machine exchange through the shared-memory operators instead, which packages call as they
call the products), a cache that is not private, or an export or compilation that fails. Processes of one machine
that compile the same graphs (a model's ranks) build one at a time (`one_build_at_a_time`). A verify step of several
rows runs under torch.compile too (speculation pays at few rows, where one row is the common case).
"""
from __future__ import annotations

import fcntl
import logging
import os
import re
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Optional

import torch

from accessory.cache_dir import cache_dir, cache_folder, scratch_folder, untrusted
from accessory.errors import ConfigError
from accessory.generation import steps
from accessory.generation.model_runner import MIN_COLUMNS
from accessory.generation.package_key import graph_family, model_key, package_key
from accessory.network.components import MoEFeedForward, decode_mask
from accessory.network.kv_caches import KVCaches

log = logging.getLogger(__name__)
PACKAGE_NAME = re.compile(r"(decode-rows|verify-slots)-(\d+)-(\d+|up)\.pt2")


def compiled_step(model, step: str) -> Callable:
    """The engine's `step` ("decode" or "verify") with compile=True: on the CPU, from packages; on CUDA,
    torch.compile's graphs (steps.compiled)."""
    if model.device.type != "cpu":
        return steps.torch_compiled(model, step)
    return PackagedStep(model, step)


class PackagedStep:
    """step(tokens, positions, mask, caches) -> logits, as `Transformer.decode` or `.verify` (`step`), from the package
    covering the call's size (decode: its rows; verify: its slots, at one row). `builds` and `loads` count the
    packages this process compiled and loaded; `reason` says why no package runs ("": they do)."""

    def __init__(self, model, step: str):
        self.model, self.step = model, step
        self.dim, self.what = steps.VARIES[step]
        self.builds = self.loads = 0
        self.reason = ""
        self.unpackaged: Optional[Callable] = None  # torch.compile's step: for what no package runs, made when needed
        self.model_key = self.family = None
        self.steps: dict[str, list[tuple[int, Optional[int], Callable]]] = {}  # key -> (fewest, most, step)
        reason = why_not_packaged(model)
        if reason is not None:
            self.use_torch_compile(reason, logging.INFO)
        else:
            self.model_key, self.family = model_key(model), graph_family(model)

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                 caches: KVCaches) -> torch.Tensor:
        if not self.reason and (self.step == "decode" or tokens.shape[0] == 1):
            step = self.step_for(tokens, positions, mask, caches)
            if step is not None:
                return step(tokens, positions, mask, caches.tensors())
        if self.unpackaged is None:
            self.unpackaged = steps.torch_compiled(self.model, self.step)
        return self.unpackaged(tokens, positions, mask, caches)

    def use_torch_compile(self, reason: str, level: int = logging.WARNING) -> None:
        self.reason = reason
        log.log(level, "the %s step is compiled with torch.compile, not packaged: %s", self.step, reason)

    def key(self, caches: KVCaches) -> str:
        """The key of the model's step on `caches` (which layers are rings)."""
        return package_key(self.model_key, caches.rings)

    def prepare(self, most: int) -> list[Path]:
        """Compile (or find) the packages covering sizes up to `most` ahead of time (`accessory compile`): decode's
        rows 1..most, verify's slots 2..most at one row; at the narrowest KV-cache width; their paths. A
        ConfigError if this model's step cannot be packaged."""
        if self.reason:
            raise ConfigError(f"the {self.step} step cannot be packaged: {self.reason}")
        columns = min(MIN_COLUMNS, self.model.args.max_seq_len)
        caches = KVCaches.allocate(self.model, max(most, 2) if self.step == "decode" else 2, columns)
        size, paths = 1 if self.step == "decode" else 2, []
        while size <= most:
            # token 0 at positions 0.., in two tensors: export takes one tensor passed twice for one input
            positions = torch.arange(size, device=self.model.device)
            positions = torch.zeros_like(positions) if self.step == "decode" else positions[None]
            with torch.inference_mode():
                self(self.model.stage_input(torch.zeros_like(positions)), positions, decode_mask(positions, columns),
                     caches)
            if self.reason:
                raise ConfigError(f"the {self.step} step cannot be packaged: {self.reason}")
            fewest, last, _ = self.loaded_step(self.key(caches), size)
            paths.append(cache_dir() / "compiled" / self.key(caches) / self.package_name(fewest, last))
            size = most + 1 if last is None else last + 1
        return paths

    def step_for(self, tokens, positions, mask, caches: KVCaches) -> Optional[Callable]:
        """The loaded step covering the call's size: already loaded, loaded from the cache, or compiled now; None if
        packaging failed (`reason` then says why)."""
        key, size = self.key(caches), tokens.shape[self.dim]
        loaded = self.loaded_step(key, size)
        if loaded is not None:
            return loaded[2]
        try:
            folder = cache_folder("compiled", key)
            doubt = untrusted(folder, cache_dir() / "compiled")
        except OSError as e:
            folder, doubt = None, f"the cache cannot be used ({e})"
        if doubt is not None:
            self.use_torch_compile(f"packages are code, and {doubt}")
            return None
        return self.load_cached(folder, size) or self.build(folder, tokens, positions, mask, caches)

    def load_cached(self, folder: Path, size: int) -> Optional[Callable]:
        """The step from a package in `folder` covering `size`, if one is there and loads; a package that does not
        load is reported and removed (then compiled again)."""
        for path in sorted(folder.glob(f"{self.step}-*.pt2")):
            fewest, most = package_sizes(path)
            if fewest is None or not covers(fewest, most, size):
                continue
            doubt = untrusted(path, cache_dir() / "compiled")
            if doubt is not None:
                log.warning("not loading the compiled %s step %s: %s; compiling it again", self.step, path, doubt)
                path.unlink(missing_ok=True)
                return None
            try:
                step = steps.load(path, self.model)
            except Exception as e:  # a corrupt or truncated package: any error the loader raises
                log.warning("the compiled %s step %s does not load (%s: %s); compiling it again", self.step, path,
                            type(e).__name__, str(e)[:300])
                path.unlink(missing_ok=True)
                return None
            self.loads += 1
            log.info("loaded the compiled %s step for %s %s from %s", self.step, self.what, _sizes_text(fewest, most),
                     path)
            return self.keep(folder.name, fewest, most, step)
        return None

    def build(self, folder: Path, tokens, positions, mask, caches: KVCaches) -> Optional[Callable]:
        """Export and compile the step for the call's size into a package in `folder` (atomically), and load it;
        one package of this model's graphs at a time on this machine (`one_build_at_a_time`)."""
        with one_build_at_a_time(folder.parent, self.family):
            return (self.load_cached(folder, tokens.shape[self.dim])
                    or self._build(folder, tokens, positions, mask, caches))

    def _build(self, folder: Path, tokens, positions, mask, caches: KVCaches) -> Optional[Callable]:
        start = time.perf_counter()
        try:
            program = steps.export_step(self.model, self.step, tokens, positions, mask, caches)
            fewest, most = steps.size_range(program, self.step)
            target = folder / self.package_name(fewest, most)
            with scratch_folder(folder) as work:
                package = steps.compile_package(program, work / target.name)
                package.chmod(0o600)  # writable by no one else whatever the umask, or no process would load it
                os.replace(package, target)
            step = steps.load(target, self.model)
        except Exception as e:  # export and inductor raise many kinds; torch.compile may still do it
            self.use_torch_compile(f"packaging it failed ({type(e).__name__}: {str(e)[:300]})")
            return None
        self.builds += 1
        log.info("compiled the %s step for %s %s into %s in %.1f s (key %s)", self.step, self.what,
                 _sizes_text(fewest, most), target, time.perf_counter() - start, folder.name)
        return self.keep(folder.name, fewest, most, step)

    def loaded_step(self, key: str, size: int) -> Optional[tuple[int, Optional[int], Callable]]:
        """(fewest, most, step) of the loaded package of `key` covering `size`, or None."""
        return next((entry for entry in self.steps.get(key, []) if covers(entry[0], entry[1], size)), None)

    def keep(self, key: str, fewest: int, most: Optional[int], step: Callable) -> Callable:
        self.steps.setdefault(key, []).append((fewest, most, step))
        return step

    def package_name(self, fewest: int, most: Optional[int]) -> str:
        return f"{self.step}-{self.what}-{fewest}-{'up' if most is None else most}.pt2"


@contextmanager
def one_build_at_a_time(compiled: Path, family: str):
    """Hold the lock (a file in the compiled cache) of the packages of one graph family (graph_family: a model's
    ranks, and other jobs of the same model and rank count): processes that compile the same graphs at once (SmolLM2
    at 3 ranks: every rank's shapes alike) race in inductor's shared cache (seen: a package that would not load, its
    JSON read empty); one after another, the later ones find inductor's cached graphs. Other models build meanwhile."""
    with open(compiled / f".building-{family}", "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another process on this machine to finish compiling the same graphs")
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def why_not_packaged(model) -> Optional[str]:
    """Why the model's steps cannot be packaged here, or None."""
    tensor = model.stage.tensor  # the ranks its collectives run over
    if tensor.world_size > 1 and tensor.local is None:
        return (f"a package's collectives must be shared-memory operators (through gloo they fail when it runs), and "
                f"this model's {tensor.world_size} tensor-parallel ranks exchange through gloo")
    if any(isinstance(module, MoEFeedForward) for module in model.modules()):
        return "a mixture of experts' dispatch (accessory::grouped_experts) is a Python operator, which an " \
               "AOTInductor package cannot call"
    return None


def package_sizes(path: Path) -> tuple[Optional[int], Optional[int]]:
    """(fewest, most) of the package at `path`'s varying size, from its name (most None: no bound); (None, None)
    for a name no package has."""
    match = PACKAGE_NAME.fullmatch(path.name)
    if match is None:
        return None, None
    return int(match[2]), None if match[3] == "up" else int(match[3])


def covers(fewest: int, most: Optional[int], size: int) -> bool:
    return fewest <= size and (most is None or size <= most)


def _sizes_text(fewest: int, most: Optional[int]) -> str:
    return str(fewest) if fewest == most else f"{fewest}..{'' if most is None else most}"

