"""Every module path a docstring or comment under accessory/ names exists: `network/components.py`,
`accessory/kernels/collectives.c`, a bare `model_runner.py`, or a dotted `accessory.generation.plan`. A file that
moves leaves no stale pointer behind. A line that names LLaMA2-Accessory may speak of that project's files, and a
`<placeholder>` stands for any file in its folder."""
from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

from conftest import REPO

FOLDERS = {"accessory", "tests", "benchmarks", "docs"} | {p.name for p in (REPO / "accessory").iterdir() if p.is_dir()}
SLASHED = re.compile(r"(?<![\w./<>-])((?:[\w-]+/)+(?:[\w-]+|<\w+>)\.(?:py|c|cpp|md))(?![\w/])")
BARE = re.compile(r"(?<![\w./-])([\w-]+\.py)\b")
DOTTED = re.compile(r"(?<![\w.])accessory(?:\.[a-z_]\w*)+")


def repo_files() -> list[str]:
    skip = {".git", ".venv", "__pycache__"}
    return [p.relative_to(REPO).as_posix() for p in REPO.rglob("*") if p.is_file() and not skip & set(p.parts)]


def prose(path: Path) -> list[str]:
    """The module's docstrings and comments, line by line, but lines about LLaMA2-Accessory's own files."""
    text = path.read_text()
    nodes = [n for n in ast.walk(ast.parse(text))
             if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
    docs = [d for d in (ast.get_docstring(n, clean=False) for n in nodes) if d]
    comments = [t.string for t in tokenize.generate_tokens(io.StringIO(text).readline) if t.type == tokenize.COMMENT]
    return [line for text in docs + comments for line in text.splitlines() if "LLaMA2-Accessory" not in line]


def _matches(file: str, ref: str) -> bool:
    """`file` is `ref`, or ends with it, a `<placeholder>` name matching any file of that folder."""
    if "<" in ref:
        folder = ref.rsplit("/", 1)[0]
        return file.startswith(folder + "/") or ("/" + folder + "/") in file
    return file == ref or file.endswith("/" + ref)


def module_exists(dotted: str) -> bool:
    """`accessory.a.b` is a package or module, or a name defined in one (`accessory.a.b.Class`)."""
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        base = REPO.joinpath(*parts[:end])
        source = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
        if source.is_file():
            rest = parts[end:]
            return not rest or (len(rest) == 1 and re.search(rf"\b{rest[0]}\b", source.read_text()) is not None)
    return False


def test_docstrings_name_only_paths_that_exist():
    files = repo_files()
    names = {Path(f).name for f in files}
    stale = []
    for path in sorted((REPO / "accessory").rglob("*.py")):
        for text in prose(path):
            refs = [r for r in SLASHED.findall(text) if r.split("/")[0] in FOLDERS]
            missing = [r for r in refs if not any(_matches(f, r) for f in files)]
            missing += [r for r in BARE.findall(text) if r not in names]
            missing += [r for r in DOTTED.findall(text) if not module_exists(r)]
            stale += [f"{path.relative_to(REPO)}: {r}" for r in missing]
    assert not stale, "docstrings or comments name paths that do not exist:\n" + "\n".join(sorted(set(stale)))
