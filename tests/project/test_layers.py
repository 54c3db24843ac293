"""The layer picture of docs/architecture.md is what the code imports: every `import accessory...` (at the top of a
module or inside a function) points to the same layer or below, generation and checkpoint never import each other,
and no package imports itself back through its own __init__ (the importers' old cycle)."""
from __future__ import annotations

import ast
from pathlib import Path

from conftest import REPO

# Lowest first. A module belongs to the longest prefix listed; each may import its own layer and those below.
LAYERS = [
    ("accessory.errors", "accessory.untrusted", "accessory.cache_dir", "accessory.presets"),  # base
    ("accessory.text", "accessory.data"),  # tokenizers, chat templates, conversation templates, images
    ("accessory.quant",),  # the quantized formats (pure torch)
    ("accessory.kernels",),
    ("accessory.parallel",),  # process groups, tensor-parallel layers, quantized weights
    ("accessory.network",),  # the blocks, the decoder and its families, the vision tower
    ("accessory.checkpoint", "accessory.generation"),  # side by side: neither imports the other
    ("accessory.runtime",),  # what MetaModel does: loading, prompts, scoring
    ("accessory.model",),  # the facade: MetaModel
    ("accessory.cli", "accessory.serve", "accessory.batch", "accessory.__main__", "accessory"),  # interfaces
]
SIBLINGS = {"accessory.checkpoint": "accessory.generation", "accessory.generation": "accessory.checkpoint"}


def place(module: str) -> tuple[int, str]:
    """(layer index, the prefix that places it)."""
    matches = [(len(prefix), i, prefix) for i, layer in enumerate(LAYERS) for prefix in layer
               if module == prefix or module.startswith(prefix + ".")]
    _, index, prefix = max(matches)
    return index, prefix


def imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("accessory"):
            found.append(node.module)
        elif isinstance(node, ast.Import):
            found += [alias.name for alias in node.names if alias.name.startswith("accessory")]
    return found


def modules() -> dict[str, Path]:
    out = {}
    for path in (REPO / "accessory").rglob("*.py"):
        parts = path.relative_to(REPO).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def test_imports_point_down_the_layers():
    wrong = []
    for module, path in modules().items():
        layer, prefix = place(module)
        for target in imports(path):
            target_layer, target_prefix = place(target)
            if target_layer > layer or SIBLINGS.get(prefix) == target_prefix:
                wrong.append(f"{module} imports {target}")
    assert not wrong, "imports against the layer picture:\n" + "\n".join(wrong)


def test_no_module_imports_names_from_its_own_package():
    """`from accessory.pkg import helper` inside accessory/pkg/ runs pkg/__init__.py, which imports its submodules:
    a cycle (the importers' old one). Submodules import each other by their own names."""
    known = modules()
    wrong = []
    for module, path in known.items():
        package = module.rpartition(".")[0] if path.name != "__init__.py" else None
        if not package or package == "accessory":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == package:
                names = [a.name for a in node.names if f"{package}.{a.name}" not in known]
                if names:
                    wrong.append(f"{module}: from {package} import {', '.join(names)}")
    assert not wrong, "\n".join(wrong)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def import_graph(name_of) -> dict[str, set[str]]:
    """Every import (top-level or inside a function) between accessory's modules, each end mapped by `name_of`."""
    known = modules()
    graph: dict[str, set[str]] = {}
    for module, path in known.items():
        for target in imports(path):
            while target not in known:  # `from pkg.mod import name` imports pkg.mod; a name is no module
                target = target.rpartition(".")[0]
            if name_of(target) != name_of(module):
                graph.setdefault(name_of(module), set()).add(name_of(target))
    return graph


def test_no_module_or_package_cycles():
    """No module imports itself back through others (lazy imports included), and no package does: a package is
    accessory's top-level module or folder (accessory.checkpoint, accessory.network, ...)."""
    def package(module: str) -> str:
        return ".".join(module.split(".")[:2])

    assert not cycles(import_graph(lambda module: module)), "module cycles"
    assert not cycles(import_graph(package)), "package cycles"
