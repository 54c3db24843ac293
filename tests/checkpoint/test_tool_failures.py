"""The weight tools leave nothing behind: killed (SIGKILL) while writing, reshard / weights extract / convert /
quantize leave no output folder, the next run removes the partial folder (saying so) and completes, and the sources
are unchanged; a destination on a disk too small (a 20 MB tmpfs) is an error naming it and the space."""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ACCESSORY = [sys.executable, "-m", "accessory"]


def checksums(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


def partial_folders(dst: Path) -> list[Path]:
    return sorted(dst.parent.glob(f".{dst.name}.partial-*"))


def kill_while_writing(command: list[str], dst: Path, shard_files: int) -> None:
    """Run `command`, SIGKILL it once its partial folder for `dst` holds `shard_files` finished shard files."""
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 300
    try:
        while time.time() < deadline:
            assert proc.poll() is None, f"finished before it was killed: {proc.stderr.read().decode()[-2000:]}"
            written = [p for folder in partial_folders(dst) for p in folder.glob("consolidated.*")]
            if len(written) > shard_files:  # the next one is being written: all before it are whole
                break
            time.sleep(0.01)
        proc.kill()
    finally:
        proc.wait()
    assert not dst.exists() and partial_folders(dst), "the run was not caught while writing"


@pytest.fixture(scope="module")
def sources(smollm2_checkpoint, tmp_path_factory):
    """The built-in model (3 shards), and a copy of it to extract a delta from."""
    root = tmp_path_factory.mktemp("tools")
    tuned = root / "tuned"
    subprocess.run([*ACCESSORY, "reshard", str(smollm2_checkpoint), str(tuned), "--shards", "3"], check=True,
                   capture_output=True)
    return smollm2_checkpoint, tuned


# convert writes through save_checkpoint's atomic folder as quantize does (the GGUF import made it a slow case)
@pytest.mark.parametrize("tool, shard_files", [("reshard", 0), ("reshard", 1), ("extract", 0), ("quantize", 0)])
def test_a_killed_tool_leaves_nothing_and_the_next_run_cleans_up(sources, tmp_path, tool,
                                                                 shard_files):
    base, tuned = sources
    dst = tmp_path / "out"
    command = {
        "reshard": [*ACCESSORY, "reshard", str(base), str(dst), "--shards", "3"],
        "extract": [*ACCESSORY, "weights", "extract", "--pretrained_path", str(base), "--delta_path", str(tuned),
                    "--output_path", str(dst), "--shards", "3"],
        "quantize": [*ACCESSORY, "quantize", str(base), str(dst), "--to", "int8", "--shards", "3"],
    }[tool]
    before = {folder: checksums(folder) for folder in (base, tuned)}
    kill_while_writing(command, dst, shard_files)
    left = partial_folders(dst)
    rerun = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert dst.is_dir() and not partial_folders(dst) and not any(p.exists() for p in left)
    assert f"removed {left[0]}" in rerun.stderr
    assert not (dst / ".accessory-writer").exists() and len(list(dst.glob("consolidated.*"))) == 3
    assert {folder: checksums(folder) for folder in (base, tuned)} == before


def test_a_destination_too_small_is_an_error_naming_it_and_the_space(smollm2_checkpoint, tmp_path):
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare (util-linux) to mount a small tmpfs")
    small = tmp_path / "small"
    small.mkdir()
    dst = small / "out"
    shell = (f"mount -t tmpfs -o size=20m tmpfs {small} && "
             f"{sys.executable} -m accessory reshard {smollm2_checkpoint} {dst} --shards 1; "
             f"echo status $?; ls -A {small}")
    run = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", shell],
                         capture_output=True, text=True, timeout=300)
    assert "status 2" in run.stdout, run.stdout + run.stderr[-3000:]
    assert f"writing {dst}: not enough disk space: shard 1 of 1 needs" in run.stderr
    assert "MiB" in run.stderr and run.stdout.strip().endswith("status 2")  # nothing left in the tmpfs
    assert not os.listdir(small)  # and nothing outside it either


@pytest.mark.parametrize("verb", ["export onnx", "reshard", "quantize"])
def test_a_destination_under_a_file_is_refused_by_name(smollm2_checkpoint, tmp_path, verb):
    """An output folder whose parent is a regular file: exit 2 naming the file (export onnx: before the model loads;
    it ended in a FileExistsError traceback before)."""
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    dst = blocker / "sub" / "out"
    extra = {"reshard": ["--shards", "1"], "quantize": ["--to", "int8"]}.get(verb, [])
    run = subprocess.run([*ACCESSORY, *verb.split(), str(smollm2_checkpoint), str(dst), *extra], capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr[-3000:]
    assert f"{dst}: cannot make a folder there, {blocker} is a file" in run.stderr
    assert blocker.read_text() == "x"
