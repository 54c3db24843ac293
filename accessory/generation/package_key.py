"""What a compiled decode package depends on, as a key: a package is reused only by a process whose key is the same.

The package holds the step's code, not its weights (they are given at load from the live model), so the key is
what shapes the code: the model's config, every weight's name, shape, dtype and layout (a quantized format shows
in its parts), the KV caches' dtype and which layers are rings, accessory's own source (the model and its kernels),
torch's version, the CPU's instruction set, and the rank among how many. New weights of the same shapes (a
fine-tuned checkpoint) reuse the package; the step computes with whatever weights the model holds.
"""
from __future__ import annotations

import functools
import hashlib
import platform
from dataclasses import asdict
from pathlib import Path

import torch

SOURCE_SUFFIXES = (".py", ".c", ".cpp")


def model_key(model) -> str:
    """The part of the key a loaded model fixes (computed once per engine: it reads no weight's values)."""
    tensor = model.stage.tensor  # the ranks the step's collectives run over (a pipeline stage's, or the whole group's)
    return _digest([*_graph_parts(model), f"rank {model.ctx.rank}",
                    f"shared-memory group {tensor.local.handle if tensor.local is not None else None}"])


def graph_family(model) -> str:
    """What the ranks of a model share whose steps compile the same graphs (their key without the rank: SmolLM2's
    ranks at 3 have the same shapes)."""
    return _digest(_graph_parts(model))


def _graph_parts(model) -> list[str]:
    return [repr(sorted(asdict(model.args).items())), type(model).__name__, str(model.dtype), *_weights_layout(model),
            source_fingerprint(), torch.__version__, platform.machine(), torch.backends.cpu.get_cpu_capability(),
            f"ranks {model.ctx.world_size}"]


@functools.cache
def package_key(model_part: str, rings: tuple[bool, ...]) -> str:
    """The whole key: the model's part and which layers' KV caches are rings (a sliding-window layer's cache is a
    ring of fixed width once the cache is wider than the window, which the step's code depends on). Asked at every
    step, so each answer is kept."""
    return _digest([model_part, "".join("r" if ring else "-" for ring in rings)])


def _weights_layout(model) -> list[str]:
    """Each module's class and format, each tensor's name, shape, dtype and strides."""
    modules = [f"{name} {type(module).__name__} {getattr(module, 'fmt', '')}" for name, module in model.named_modules()]
    tensors = [f"{name} {tuple(t.shape)} {t.dtype} {t.stride()}"
               for name, t in [*model.named_parameters(), *model.named_buffers()]]
    return modules + tensors


@functools.cache
def source_fingerprint() -> str:
    """A hash of accessory's source files (the model's code and its kernels shape the compiled step), once per
    process: the code a process runs is what it read at its start, whatever its files become later."""
    root = Path(__file__).resolve().parent.parent  # the accessory package
    files = sorted(p for p in root.rglob("*") if p.suffix in SOURCE_SUFFIXES and p.is_file())
    digest = hashlib.sha256()
    for path in files:
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def _digest(parts: list[str]) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]
