"""Packaging: `accessory --version` printing the one version; setup.py's extras against what each part imports; the
licence.

The extras cannot drift from the code: every third-party module imported (at the top of a file or inside a
function) by accessory/ must come from install_requires (or the `cuda` extra: triton, for the GPU kernels), by
accessory/serve/ from it or the `serve` extra, by demos/ from it or the `demo` extra, by tests/ from any of them or
the `test` extra; and `serve` and `demo` hold nothing their part does not import. The pinned requirements files
name every one of them, so `make setup` installs them.
"""
from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from importlib.metadata import packages_distributions

import pytest

from conftest import REPO

import accessory


def setup_keywords() -> dict:
    """The literal keyword arguments of setup.py's setup() call (the computed ones, such as version, left out)."""
    tree = ast.parse((REPO / "setup.py").read_text())
    call = next(node for node in ast.walk(tree) if isinstance(node, ast.Call) and getattr(node.func, "id", "") ==
                "setup")
    keywords = {}
    for keyword in call.keywords:
        try:
            keywords[keyword.arg] = ast.literal_eval(keyword.value)
        except ValueError:
            continue
    return keywords


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def names(requirements, extras: dict) -> set[str]:
    """Distribution names of requirement strings, a self-reference such as accessory[serve,demo] expanded."""
    out = set()
    for requirement in requirements:
        name, own_extras = re.match(r"([A-Za-z0-9_.-]+)(?:\[([^\]]*)\])?", requirement).groups()
        if canonical(name) == "accessory":
            for extra in own_extras.split(","):
                out |= names(extras[extra.strip()], extras)
        else:
            out.add(canonical(name))
    return out


# Scripts that tests and demos import as modules (their folders are on sys.path)
SCRIPTS = {p.stem for folder in ("tests", "demos") for p in (REPO / folder).glob("*.py")}


def imported_distributions(files) -> set[str]:
    """The distributions of the third-party modules `files` import (the standard library, accessory and the
    scripts of tests/ and demos/ left out)."""
    modules = set()
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                modules |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                modules.add(node.module.split(".")[0])
    modules -= set(sys.stdlib_module_names) | SCRIPTS | {"accessory"}
    found = packages_distributions()
    return {canonical(found.get(module, [module])[0]) for module in modules}


def requirements_file(name: str) -> set[str]:
    lines = (REPO / name).read_text().splitlines()
    return {canonical(re.split(r"[\s<>=!~;\[]", line)[0]) for line in lines if line and line[0] not in "#-"}


KEYWORDS = setup_keywords()
EXTRAS = KEYWORDS["extras_require"]
CORE = names(KEYWORDS["install_requires"], EXTRAS)
PARTS = {
    "core": [p for p in (REPO / "accessory").rglob("*.py") if "serve" not in p.relative_to(REPO).parts],
    "serve": sorted((REPO / "accessory" / "serve").glob("*.py")),
    "demo": sorted((REPO / "demos").glob("*.py")),
    "test": sorted((REPO / "tests").glob("*.py")),
}


@pytest.mark.parametrize("part", PARTS)
def test_extras_cover_what_each_part_imports(part):
    needed = imported_distributions(PARTS[part]) - CORE
    optional = EXTRAS["cuda"] + EXTRAS["onnx"] + EXTRAS["energy"]  # imported by core only where they are used
    declared = names(EXTRAS.get(part, []) + (optional if part == "core" else []), EXTRAS)
    if part in ("serve", "demo"):
        assert needed == declared, f"extras_require[{part!r}] must be what {part} imports"
    else:
        assert needed <= declared, f"{part} imports {sorted(needed - declared)}, which setup.py does not require"


def test_requirements_files_install_every_dependency():
    assert CORE | names(EXTRAS["serve"] + EXTRAS["demo"], EXTRAS) <= requirements_file("requirements.txt")
    assert names(EXTRAS["test"], EXTRAS) - requirements_file("requirements.txt") <= requirements_file(
        "requirements-test.txt")


def test_version_is_written_once(capsys):
    from accessory.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == f"accessory {accessory.__version__}\n"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    run = [subprocess.run([sys.executable, *argv], cwd=REPO, env=env, capture_output=True, text=True, check=True)
           for argv in (["-m", "accessory", "--version"], ["setup.py", "--version"])]
    assert [r.stdout.splitlines()[-1] for r in run] == [f"accessory {accessory.__version__}", accessory.__version__]


def test_license_is_apache_2():
    text = (REPO / "LICENSE").read_text()
    assert text.split()[:4] == ["Apache", "License", "Version", "2.0,"] and "END OF TERMS AND CONDITIONS" in text
    assert (KEYWORDS["license"], KEYWORDS["license_files"]) == ("Apache-2.0", ["LICENSE"])


def test_built_wheel_imports_every_module(tmp_path):
    """A built wheel (not the editable install of `make setup`) holds every package, module and data file of the
    source tree, and each of its modules imports from the unpacked wheel alone: a folder without `__init__.py` is
    left out by find_packages, and `import accessory.model.meta` then failed on `accessory.quant`."""
    import shutil
    import zipfile

    # Built from a copy: setuptools reuses a build/ folder left in the source tree, which can hide a missing package.
    source = tmp_path / "source"
    for folder in ("accessory", "configs"):
        shutil.copytree(REPO / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("setup.py", "MANIFEST.in", "LICENSE"):
        shutil.copy(REPO / name, source)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path / "dist"), str(source)], check=True, capture_output=True, cwd=tmp_path)
    wheel, = (tmp_path / "dist").glob("accessory-*.whl")
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(site)
        shipped = {name for name in archive.namelist() if name.startswith("accessory/")}
    sources = {str(p.relative_to(REPO)) for p in (REPO / "accessory").rglob("*")
               if p.suffix in (".py", ".c", ".cpp") and "__pycache__" not in p.parts}
    configs = {"accessory/" + str(p.relative_to(REPO)) for p in (REPO / "configs").rglob("*.*")}
    assert sources | configs <= shipped, f"missing from the wheel: {sorted((sources | configs) - shipped)}"
    modules = sorted(name[:-3].replace("/", ".").removesuffix(".__init__") for name in shipped
                     if name.endswith(".py"))
    probe = ("import importlib, sys\n"
             "for name in sys.argv[1:]:\n"
             "    module = importlib.import_module(name)\n"
             f"    assert module.__file__.startswith({str(site)!r}), (name, module.__file__)\n")
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    # -I: no user site, no current folder, no PYTHONPATH; the unpacked wheel is the only place accessory can be.
    run = subprocess.run([sys.executable, "-I", "-c", f"import sys; sys.path.insert(0, {str(site)!r})\n" + probe,
                          *modules], env=env, cwd=tmp_path, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
