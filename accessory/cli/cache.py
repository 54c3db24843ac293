"""`accessory cache ls` / `accessory cache rm`: what the runtime keeps in its cache folder (cache_dir.py: imports of
GGUF files and HF folders, compiled decode steps, CPU kernels, the built-in model) and removing it. Nothing in the
cache is ever evicted on its own: a removed entry is made again when it is next needed."""
from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from accessory.cache_dir import cache_dir
from accessory.cli.options import positive_float
from accessory.errors import ConfigError

KINDS = ("imported", "compiled", "kernels")  # folders of entries; anything else at the top is an entry of its own


def add_cache_verb(verbs) -> None:
    cache = verbs.add_parser("cache", help="list or remove what the runtime keeps in its cache folder")
    actions = cache.add_subparsers(dest="action", required=True)
    ls = actions.add_parser("ls", help="each entry: its name, kind, size and when it was written")
    ls.add_argument("--json", action="store_true", help="one JSON object per entry")
    ls.set_defaults(handler=run_ls)
    rm = actions.add_parser("rm", help="remove entries (made again when next needed)")
    rm.add_argument("names", nargs="*", help="entries as `cache ls` names them (kind/name)")
    rm.add_argument("--kind", choices=[*KINDS, "other"], help="only entries of this kind")
    rm.add_argument("--older-than", type=positive_float, metavar="DAYS", help="entries written more than DAYS ago")
    rm.add_argument("--all", action="store_true", help="every entry (of --kind, if given)")
    rm.set_defaults(handler=run_rm)


@dataclass(frozen=True)
class Entry:
    path: Path
    kind: str

    @property
    def name(self) -> str:
        return self.path.relative_to(cache_dir()).as_posix()

    def size(self) -> int:
        files = [self.path] if self.path.is_file() else self.path.rglob("*")
        return sum(p.stat().st_size for p in files if p.is_file() and not p.is_symlink())

    def written(self) -> float:
        return self.path.lstat().st_mtime


def entries() -> list[Entry]:
    """Every entry of the cache: each folder (or file) inside imported/, compiled/, kernels/; every other top-level
    folder or file (the built-in model's folders) as one entry of kind "other"."""
    root = cache_dir()
    if not root.is_dir():
        return []
    found = []
    for top in sorted(root.iterdir()):
        if top.name in KINDS and top.is_dir() and not top.is_symlink():
            found += [Entry(path, top.name) for path in sorted(top.iterdir())]
        else:
            found.append(Entry(top, "other"))
    return found


def run_ls(args) -> None:
    now = time.time()
    for entry in entries():
        size, age = entry.size(), (now - entry.written()) / 86400
        if args.json:
            print(json.dumps({"name": entry.name, "kind": entry.kind, "bytes": size,
                              "written_days_ago": round(age, 2)}))
        else:
            print(f"{entry.name}\t{entry.kind}\t{size / 2 ** 20:.1f} MiB\t{age:.1f} days ago")


def run_rm(args) -> None:
    if bool(args.names) + bool(args.all or args.older_than is not None) != 1:
        raise ConfigError("accessory cache rm: name entries (as `cache ls` prints them), or give --all or "
                          "--older-than DAYS (with --kind to narrow either), not both")
    known = {entry.name: entry for entry in entries()}
    if args.names:
        missing = [name for name in args.names if name not in known]
        if missing:
            raise ConfigError(f"accessory cache rm: no entry {missing[0]!r} in {cache_dir()} (see accessory cache ls)")
        chosen = [known[name] for name in args.names]
    else:
        cutoff = time.time() - (args.older_than or 0) * 86400
        chosen = [entry for entry in known.values() if (args.kind in (None, entry.kind))
                  and (args.older_than is None or entry.written() < cutoff)]
    for entry in chosen:
        remove(entry)
        print(f"removed {entry.name}", flush=True)


def remove(entry: Entry) -> None:
    """The entry (an import's lock file, imported/NAME.lock, is an entry of its own: remove none while an import
    runs)."""
    if entry.path.is_dir() and not entry.path.is_symlink():
        shutil.rmtree(entry.path)
    else:
        entry.path.unlink(missing_ok=True)
