"""`accessory cache ls / rm` on a cache folder of its own ($ACCESSORY_CACHE): every entry listed with its kind and
size; removed by name, by age and kind, or all; a name not in the cache, or names with --all, refused by name."""
from __future__ import annotations

import json
import os
import time
from types import SimpleNamespace

import pytest


@pytest.fixture
def cache(monkeypatch, capsys, caplog):
    """`accessory cache ARGS` in this process, on the cache folder `root`: its exit status, stdout and log."""
    from accessory.cli import main

    def run(root, *args: str) -> SimpleNamespace:
        monkeypatch.setenv("ACCESSORY_CACHE", str(root))
        caplog.clear()
        try:
            main(["cache", *args])
            code = 0
        except SystemExit as e:
            code = e.code
        return SimpleNamespace(returncode=code, stdout=capsys.readouterr().out, stderr=caplog.text)
    return run


def test_cache_lists_and_removes_entries(tmp_path, cache):
    (tmp_path / "imported" / "model-gguf-1f2e").mkdir(parents=True)
    (tmp_path / "imported" / "model-gguf-1f2e" / "consolidated.00-of-01.model.pth").write_bytes(b"x" * 3000)
    (tmp_path / "imported" / "model-gguf-1f2e.lock").touch()
    for name in ("old", "new"):
        (tmp_path / "compiled" / name).mkdir(parents=True)
    month_ago = time.time() - 30 * 86400
    os.utime(tmp_path / "compiled" / "old", (month_ago, month_ago))
    (tmp_path / "smollm2-3shards").mkdir()

    listed = [json.loads(line) for line in cache(tmp_path, "ls", "--json").stdout.splitlines()]
    assert [(e["name"], e["kind"]) for e in listed] == [
        ("compiled/new", "compiled"), ("compiled/old", "compiled"), ("imported/model-gguf-1f2e", "imported"),
        ("imported/model-gguf-1f2e.lock", "imported"), ("smollm2-3shards", "other")]
    assert listed[2]["bytes"] == 3000 and listed[1]["written_days_ago"] >= 29.9

    assert cache(tmp_path, "rm", "--kind", "compiled", "--older-than", "7").stdout == "removed compiled/old\n"
    refused = cache(tmp_path, "rm", "imported/elsewhere")
    assert refused.returncode == 2 and "no entry 'imported/elsewhere'" in refused.stderr
    both = cache(tmp_path, "rm", "compiled/new", "--all")
    assert both.returncode == 2 and "not both" in both.stderr and (tmp_path / "compiled" / "new").is_dir()
    assert cache(tmp_path, "rm", "imported/model-gguf-1f2e").returncode == 0
    assert not (tmp_path / "imported" / "model-gguf-1f2e").exists()
    assert cache(tmp_path, "rm", "--all").returncode == 0
    assert cache(tmp_path, "ls").stdout == "" and (tmp_path / "imported").is_dir()
