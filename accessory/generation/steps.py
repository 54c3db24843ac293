"""How the engine's steps are compiled: `Transformer.decode` (one token per row) and `Transformer.verify` (several
per row: speculative decoding), under torch.compile (`compiled`) or as AOTInductor packages (`export_step`,
`compile_package`, `load`). packaged_steps.py decides which, and keeps the packages in the cache; nothing else
compiles a step.

A package is the step exported with the KV caches as inputs (torch.export, sizes symbolic), compiled by inductor into
a shared library, and the weights left out of it, to be given back at load time from the live model (no second copy
in memory or on disk). Its varying size (`VARIES`): a decode step's rows; a verify step's slots (tokens per row), at
one row, where speculation pays (several rows verify under torch.compile). One package covers a range of that size:
the CPU kernels take a different path for one row, and above a few rows the library's GEMM replaces them, so export
narrows the size to the range the traced call's path holds for (`size_range`); packaged_steps.py keeps one package
per range it meets.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

import torch
import torch.fx.experimental._config as fx_config
import torch.utils._pytree as pytree
from torch.export import Dim
from torch.utils._sympy.numbers import int_oo

from accessory.network.kv_caches import KVCaches


# The size a package of each step varies in: (the tokens' dimension, what it counts).
VARIES = {"decode": (0, "rows"), "verify": (1, "slots")}


def compiled(decode, device: torch.device, size_guards: bool = False):
    """`decode` under torch.compile, as one graph with symbolic sizes (rows and columns vary as requests come and
    go; a size of 1 gets its own graph), captured as CUDA graphs on CUDA (one per shape the buckets allow). On the
    CPU, inductor's wrapper that calls the graph's kernels is C++ (`cpp_wrapper`), not Python: with about 150 calls
    per step, 1.7 ms less per step here.

    Guards: dynamo re-checks every module attribute the step reads on every call (about 1 ms here). Only tensor
    guards are kept, on every tensor but the parameters (the inputs, the KV cache, the quantized weights): a
    loaded model's parameters and attributes never change, and whatever else might is a tensor.

    Sizes: the rows decoded and the KV cache's rows are independent, though often equal when a graph is traced;
    without duck shapes they get symbols of their own (else the graph took them for one size, and a later call where
    they differ failed its size checks: guards on sizes are among those dropped).

    `size_guards`: keep every guard, for a step whose graph may specialize a size (the verify step's slots and
    attention width did): a call whose sizes the graph cannot take compiles another instead of failing its size
    checks, for about 1 ms more per call."""
    options = {} if size_guards else {"guard_filter_fn": torch.compiler.keep_tensor_guards_unsafe}
    if device.type == "cuda":
        options["triton.cudagraphs"] = True
    else:
        options["cpp_wrapper"] = True
    step = torch.compile(decode, fullgraph=True, dynamic=True, options=options)

    def call(*args):
        with fx_config.patch(use_duck_shape=False):
            return step(*args)

    return call


def torch_compiled(model, step: str) -> Callable:
    """`model.decode` or `model.verify` (`step`) under torch.compile; verify keeps every guard (its graph may
    specialize a size: the slots, the width)."""
    return compiled(getattr(model, step), model.device, size_guards=step == "verify")


class StepOnCaches(torch.nn.Module):
    """`model.decode` or `model.verify` (`step`) with every layer's KV cache an input: forward(tokens, positions,
    mask, caches), caches a list of (keys, values) per layer (`KVCaches.tensors`), written in place as the step
    writes its own; `rings`: which layers' caches are sliding-window rings (part of the graph: package_key.py keys
    packages on them)."""

    def __init__(self, model, step: str, rings: tuple[bool, ...]):
        super().__init__()
        self.model, self.step, self.rings = model, step, rings

    def forward(self, tokens, positions, mask, caches):
        return getattr(self.model, self.step)(tokens, positions, mask,
                                              KVCaches.of_tensors(caches, mask.shape[-1], self.rings))


def export_step(model, step: str, tokens, positions, mask, caches: KVCaches) -> torch.export.ExportedProgram:
    """`StepOnCaches(model, step)` exported from one call's inputs (fake copies: nothing is written): its varying
    size (decode: rows; verify: slots, at one row), cache rows, cache columns (not a ring's: its width is fixed) and
    mask columns symbolic. Sizes that happen to be equal in this call get symbols of their own (no duck shapes), so
    no later call is taken for one with equal sizes."""
    auto = Dim.AUTO
    cache_dims = [{0: auto} if cache.ring else {0: auto, 2: auto} for cache in caches.layers]
    if step == "decode":  # one row is a graph of its own (a size of 1 is never symbolic)
        rows = Dim.STATIC if tokens.shape[0] == 1 else auto
        inputs = {"tokens": {0: rows}, "positions": {0: rows}, "mask": {0: rows, 3: auto}}
    else:
        if tokens.shape[0] != 1:
            raise ValueError(f"a verify step is packaged for one row; this call has {tokens.shape[0]}")
        inputs = {"tokens": {1: auto}, "positions": {1: auto}, "mask": {2: auto, 3: auto}}
    dynamic = {**inputs, "caches": [(dims, dims) for dims in cache_dims]}
    try:
        with torch.no_grad(), fx_config.patch(use_duck_shape=False):
            return torch.export.export(StepOnCaches(model, step, caches.rings).eval(),
                                       (tokens, positions, mask, caches.tensors()), dynamic_shapes=dynamic,
                                       strict=False)
    finally:  # export strips dynamo's size markings from its inputs, the live caches: a graph compiled later would
        for cache in caches.layers:  # take their heads for symbolic, and compile again for a new cache
            cache.mark_sizes()


def size_range(program: torch.export.ExportedProgram, step: str) -> tuple[int, Optional[int]]:
    """(fewest, most) of the exported step's varying size (most None: no bound), read off its `tokens` input. Only
    that size may be narrowed: a bound on any other (cache rows or columns, mask columns) is a RuntimeError, since
    the engine picks a package by that size alone."""
    dim, what = VARIES[step]
    placeholder = next(node for node in program.graph.nodes if node.op == "placeholder" and node.name == "tokens")
    size = placeholder.meta["val"].shape[dim]
    varying = None if isinstance(size, int) else size.node.expr
    for symbol, bounds in program.range_constraints.items():
        if symbol != varying and (bounds.lower > 2 or bounds.upper != int_oo):
            raise RuntimeError(f"the exported {step} step bounds a size other than its {what} to {bounds}")
    if varying is None:
        return size, size
    bounds = program.range_constraints[varying]
    return int(bounds.lower), (None if bounds.upper == int_oo else int(bounds.upper))


def compile_package(program: torch.export.ExportedProgram, path: Path) -> Path:
    """Compile `program` into the AOTInductor package `path`, its weights left out (given at load: `load`)."""
    options = {"aot_inductor.package_constants_in_so": False}
    return Path(torch._inductor.aoti_compile_and_package(program, package_path=str(path),
                                                         inductor_configs=options))


def load(path: Path, model) -> "LoadedStep":
    """The compiled step in package `path`, given the live model's weights (shared, not copied). Called as
    step(tokens, positions, mask, caches.tensors()) -> logits."""
    runner = torch._inductor.aoti_load_package(str(path))
    constants = {name: _attribute(model, name.removeprefix("model.")) for name in runner.get_constant_fqns()}
    runner.load_constants(constants, check_full_update=True, user_managed=True)
    return LoadedStep(runner.loader)


class LoadedStep:
    """A package's step called with its inputs flat (tokens, positions, mask, then each layer's keys and values, the
    order pytree flattens them in): torch's own wrapper flattens them with pytree and parses the call spec at every
    call, about half a millisecond a step here."""

    def __init__(self, loader):
        self.loader = loader
        if not pytree.treespec_loads(loader.get_call_spec()[1]).is_leaf():
            raise RuntimeError("the package's step returns more than its logits")

    def __call__(self, tokens, positions, mask, caches) -> torch.Tensor:
        return self.loader.boxed_run([tokens, positions, mask, *(t for pair in caches for t in pair)])[0]


def _attribute(module: torch.nn.Module, name: str) -> torch.Tensor:
    value = module
    for part in name.split("."):
        value = getattr(value, part)
    if not isinstance(value, torch.Tensor):
        raise RuntimeError(f"the package's constant {name} is a {type(value).__name__} in the model, not a tensor")
    return value
