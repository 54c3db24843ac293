"""Where the runtime keeps what it makes once per machine: the imported default model, compiled CPU kernels."""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """$ACCESSORY_CACHE, else $XDG_CACHE_HOME/accessory, else ~/.cache/accessory."""
    root = os.environ.get("ACCESSORY_CACHE") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"),
                                                     "accessory")
    return Path(root)
