"""The layer picture of docs/architecture.md is what the code imports: every `import accessory...` (at the top of a
module or inside a function) points to the same layer or below, generation and checkpoint never import each other,
and no package imports itself back through its own __init__ (the importers' old cycle)."""
from __future__ import annotations

import ast
from pathlib import Path

from conftest import REPO

# Lowest first. A module belongs to the longest prefix listed; each may import its own layer and those below.
LAYERS = [
    ("accessory.errors", "accessory.jsonfile", "accessory.cache", "accessory.presets"),
    ("accessory.model.tokenizer", "accessory.model.template_sandbox", "accessory.data"),  # text
    ("accessory.quant.formats",),
    ("accessory.kernels",),
    ("accessory.quant",),
    ("accessory.parallel",),
    ("accessory.model.components", "accessory.model.vision", "accessory.model.LLM", "accessory.model.memory"),  # model
    ("accessory.checkpoint", "accessory.generation"),  # side by side: neither imports the other
    ("accessory.model.meta",),  # the facade
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
