"""Where the runtime keeps what it makes once per machine: the imported default model, compiled CPU kernels.

What the runtime loads back from here must be what it wrote: the folders it creates are private (0700), and code
(the compiled kernels) is loaded only from folders that `untrusted` finds no one else could have written.
"""
from __future__ import annotations

import os
import shutil
import stat
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

SCRATCH = "tmp-"  # a build's scratch folder: tmp-<pid>-<random>, removed at its end
STALE_S = 3600  # ... or, if its process died (killed mid-build), by the next build here after this long


def cache_dir() -> Path:
    """$ACCESSORY_CACHE, else $XDG_CACHE_HOME/accessory, else ~/.cache/accessory."""
    root = os.environ.get("ACCESSORY_CACHE") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"),
                                                     "accessory")
    return Path(root)


def cache_folder(*parts: str) -> Path:
    """cache_dir() / parts, each folder of it created where missing as private to you (0700)."""
    folder = cache_dir()
    folder.parent.mkdir(parents=True, exist_ok=True)
    folder.mkdir(mode=0o700, exist_ok=True)
    for part in parts:
        folder = folder / part
        folder.mkdir(mode=0o700, exist_ok=True)
    return folder


def untrusted(path: Path, mine_from: Path) -> Optional[str]:
    """Why `path` (at or under the folder `mine_from`) could hold what another user wrote, or None if it could not:
    `mine_from`, every folder below it down to `path`, and `path` must be yours and writable by no one else, and the
    folder holding `mine_from` yours or root's and writable by no one else unless sticky (as /tmp is), so that no one
    can put their own folder in its place. Links are followed."""
    uid = os.geteuid()
    holder = mine_from.parent.stat()
    if holder.st_uid not in (uid, 0):
        return f"{mine_from.parent} is owned by uid {holder.st_uid}, not by you (uid {uid}) or root"
    if holder.st_mode & 0o022 and not holder.st_mode & stat.S_ISVTX:
        return f"{mine_from.parent} is writable by others ({stat.filemode(holder.st_mode)})"
    mine = [p for p in (path, *path.parents) if p == mine_from or mine_from in p.parents]
    for part in reversed(mine):
        status = part.stat()
        if status.st_uid != uid:
            return f"{part} is owned by uid {status.st_uid}, not by you (uid {uid})"
        if status.st_mode & 0o022:
            return f"{part} is writable by others ({stat.filemode(status.st_mode)})"
    return None


@contextmanager
def scratch_folder(parent: Path) -> Iterator[Path]:
    """A private scratch folder in `parent` for one build, removed when it ends; first, the scratch folders of
    builds whose process is gone (killed) and that are older than STALE_S, which nothing else removes."""
    sweep_scratch(parent)
    with tempfile.TemporaryDirectory(dir=parent, prefix=f"{SCRATCH}{os.getpid()}-") as work:
        yield Path(work)


def sweep_scratch(parent: Path) -> None:
    now = time.time()
    for folder in parent.glob(f"{SCRATCH}*-*"):
        pid = folder.name[len(SCRATCH):].split("-", 1)[0]
        try:
            stale = pid.isdigit() and not _alive(int(pid)) and now - folder.stat().st_mtime > STALE_S
        except OSError:  # another build removed it meanwhile
            continue
        if stale:
            shutil.rmtree(folder, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
