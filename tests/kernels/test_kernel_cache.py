"""The compiled CPU kernels are code: a library found in $ACCESSORY_CACHE/kernels/<key>/ is loaded only if no other
user could have written it (the probe of issue 20 planted one in a world-writable cache, and its constructor ran).
Otherwise the kernels are built again in a private temporary folder, with a warning naming what is wrong.

The compiler is replaced by a stand-in that writes b"built" (the real build takes seconds and is tested wherever
the kernels run); what is checked is which file `_build` hands to torch.ops.load_library.
"""
from __future__ import annotations

import logging
import os
import stat

import pytest

from accessory.kernels import build

KEY = "0123456789abcdef"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty $ACCESSORY_CACHE; `compiled` counts the builds."""
    monkeypatch.setenv("ACCESSORY_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(build, "_library_key", lambda: KEY)
    compiled = []

    def stand_in(work):
        compiled.append(work)
        (work / build.LIBRARY).write_bytes(b"built")
        (work / build.LIBRARY).chmod(0o700)
        return work / build.LIBRARY

    monkeypatch.setattr(build, "_compile", stand_in)
    return tmp_path / "cache", compiled


def mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_the_cache_is_created_private_and_its_library_reused(cache):
    root, compiled = cache
    library = build._build()
    assert library == root / "kernels" / KEY / build.LIBRARY and library.read_bytes() == b"built"
    assert [mode(p) for p in (root, root / "kernels", root / "kernels" / KEY)] == [0o700] * 3
    assert build._build() == library and len(compiled) == 1  # the second process loads what the first built


def plant(root, folder_modes: dict, file_mode=0o700):
    """A library written into the cache as someone else could have, then the folders' modes set."""
    folder = root / "kernels" / KEY
    folder.mkdir(parents=True)
    (folder / build.LIBRARY).write_bytes(b"planted")
    (folder / build.LIBRARY).chmod(file_mode)
    for relative, folder_mode in folder_modes.items():
        (root / relative).chmod(folder_mode)


@pytest.mark.parametrize("folder_modes, file_mode, named", [
    ({"kernels": 0o777}, 0o700, "kernels is writable by others (drwxrwxrwx)"),
    ({f"kernels/{KEY}": 0o775}, 0o700, f"{KEY} is writable by others (drwxrwxr-x)"),
    ({}, 0o666, f"{build.LIBRARY} is writable by others (-rw-rw-rw-)"),
    ({".": 0o777}, 0o700, "cache is writable by others (drwxrwxrwx)"),  # the probe's world-writable cache root
])
def test_a_library_others_could_have_written_is_not_loaded(folder_modes, file_mode, named, cache, caplog):
    root, compiled = cache
    plant(root, folder_modes, file_mode)
    with caplog.at_level(logging.WARNING, "accessory.kernels.build"):
        library = build._build()
    assert library.read_bytes() == b"built" and root not in library.parents
    assert mode(library.parent) == 0o700 and len(compiled) == 1  # built again, in a private temporary folder
    assert f"not loading the CPU kernels cached in {root / 'kernels' / KEY}" in caplog.text and named in caplog.text
    assert (root / "kernels" / KEY / build.LIBRARY).read_bytes() == b"planted"  # left as it was


def test_a_library_in_a_folder_of_another_user_is_not_loaded(cache, caplog, monkeypatch):
    """Seen from another uid, the same cache is someone else's: owner, not only mode, decides."""
    root, compiled = cache
    plant(root, {})
    uid = os.geteuid()
    monkeypatch.setattr(os, "geteuid", lambda: uid + 1)
    with caplog.at_level(logging.WARNING, "accessory.kernels.build"):
        library = build._build()
    assert library.read_bytes() == b"built" and root not in library.parents
    assert f"is owned by uid {uid}, not by you (uid {uid + 1})" in caplog.text


def test_a_sticky_shared_root_is_fine_when_the_kernels_folder_is_yours(cache):
    """As in /tmp: others may write the root, but cannot replace a folder of yours in it."""
    root, compiled = cache
    plant(root, {".": 0o1777})
    assert build._build() == root / "kernels" / KEY / build.LIBRARY and compiled == []
