"""A rank's memory budget (network/memory.py `memory_budget`, `cgroup_room`): ACCESSORY_MEMORY_BUDGET, else the least
of MemAvailable and the room under the process's own memory cgroup (v1 and v2, its parents' limits too), shared by
the machine's ranks. Oracles: cgroup files written by hand; as root, a real cgroup v1 limit around a process, which
must refuse a config that MemAvailable alone would let it try."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

from accessory.errors import ConfigError
from accessory.network import memory
from accessory.network.memory import cgroup_room, memory_budget


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_a_v2_cgroup_counts_its_own_limit_and_its_parents(tmp_path):
    root, proc = tmp_path / "cgroup", tmp_path / "proc_cgroup"
    write(proc, "0::/job/rank1\n")
    write(root / "job" / "memory.max", "1000\n")
    write(root / "job" / "memory.current", "300\n")
    write(root / "job" / "rank1" / "memory.max", "max\n")
    write(root / "job" / "rank1" / "memory.current", "200\n")
    assert cgroup_room(proc, root) == [(700, f"the memory limit in {root / 'job' / 'memory.max'}")]
    write(root / "job" / "rank1" / "memory.max", "500\n")  # its own, lower
    assert cgroup_room(proc, root) == [(300, f"the memory limit in {root / 'job' / 'rank1' / 'memory.max'}")]


def test_a_v1_cgroup_reads_the_memory_controllers_line_and_no_limit_is_none(tmp_path):
    root, proc = tmp_path / "cgroup", tmp_path / "proc_cgroup"
    write(proc, "9:name=systemd:/\n5:cpu,cpuacct:/other\n4:memory:/rank0\n0::/\n")
    write(root / "memory" / "memory.limit_in_bytes", "9223372036854771712\n")  # v1's "no limit"
    write(root / "memory" / "memory.usage_in_bytes", "1\n")
    assert cgroup_room(proc, root) == []
    write(root / "memory" / "rank0" / "memory.limit_in_bytes", "2000\n")
    write(root / "memory" / "rank0" / "memory.usage_in_bytes", "2500\n")  # over its limit: no room at all
    assert cgroup_room(proc, root) == [(0, f"the memory limit in {root / 'memory' / 'rank0' / 'memory.limit_in_bytes'}")]


def test_no_cgroup_file_means_no_limit(tmp_path):
    assert cgroup_room(tmp_path / "missing", tmp_path) == []
    write(tmp_path / "proc_cgroup", "not a cgroup line\n0::/x\n")
    assert cgroup_room(tmp_path / "proc_cgroup", tmp_path / "empty") == []


def test_the_budget_is_the_least_figure_ram_shared_by_the_machines_ranks(monkeypatch):
    """The RAM is shared by the machine's ranks; a cgroup's room comes already shared by the ranks inside it."""
    monkeypatch.delenv(memory.BUDGET_ENV, raising=False)
    monkeypatch.setattr(memory, "available_ram", lambda: 9000)
    monkeypatch.setattr(memory, "cgroup_room", lambda: [(2500, "the memory limit in X")])
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    assert memory_budget(torch.device("cpu")) == (2500, "the memory limit in X")
    monkeypatch.setattr(memory, "cgroup_room", lambda: [(4000, "the memory limit in X")])
    assert memory_budget(torch.device("cpu")) == (3000, "available RAM / 3 local ranks")
    monkeypatch.setattr(memory, "cgroup_room", lambda: [])
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert memory_budget(torch.device("cpu")) == (9000, "available RAM")
    monkeypatch.setenv(memory.BUDGET_ENV, "123")
    assert memory_budget(torch.device("cpu")) == (123, memory.BUDGET_ENV)
    monkeypatch.setenv(memory.BUDGET_ENV, "lots")
    with pytest.raises(ConfigError, match="ACCESSORY_MEMORY_BUDGET must be a positive number of bytes per rank, got "
                                          "'lots'"):
        memory_budget(torch.device("cpu"))


def test_a_limit_is_shared_by_the_ranks_inside_it(tmp_path):
    """A job's cgroup holding 2 ranks halves its room for each; a rank's own cgroup below it is its alone."""
    root, proc = tmp_path / "cgroup", tmp_path / "proc_cgroup"
    write(proc, "0::/job/rank1\n")
    write(root / "job" / "memory.max", "1000\n")
    write(root / "job" / "memory.current", "200\n")
    ranks_in = lambda group: 2 if group == root / "job" else 1  # noqa: E731
    assert cgroup_room(proc, root, ranks_in) == [(400, f"the memory limit in {root / 'job' / 'memory.max'} / 2 ranks "
                                                       f"in it")]
    write(root / "job" / "rank1" / "memory.max", "450\n")
    write(root / "job" / "rank1" / "memory.current", "100\n")
    assert cgroup_room(proc, root, ranks_in) == [(350, f"the memory limit in {root / 'job' / 'rank1' / 'memory.max'}")]


V1_MEMORY = Path("/sys/fs/cgroup/memory")


@pytest.mark.skipif(os.geteuid() != 0 or not (V1_MEMORY / "cgroup.procs").exists(),
                    reason="needs root and cgroup v1's memory controller")
def test_a_process_in_a_memory_cgroup_is_refused_a_model_its_limit_cannot_hold(tiny_checkpoints, tmp_path):
    """About 5.5 GB of float32 weights: MemAvailable on this machine may hold them, a 1.5 GiB cgroup cannot."""
    from test_reliability import hostile_copy

    folder = hostile_copy(tiny_checkpoints["mha", 1], tmp_path, {"dim": 4096, "n_heads": 32, "n_kv_heads": 32,
                                                                  "hidden_dim": 11008, "n_layers": 8})
    group = V1_MEMORY / f"accessory-test-{uuid.uuid4().hex[:8]}"
    group.mkdir()
    try:
        (group / "memory.limit_in_bytes").write_text(str(3 << 29))
        script = ("import os\n"
                  f"open({str(group / 'cgroup.procs')!r}, 'w').write(str(os.getpid()))\n"
                  "from accessory.errors import ConfigError\nfrom accessory.model.meta import MetaModel\n"
                  f"try:\n    MetaModel.from_pretrained({str(folder)!r}, max_seq_len=64)\n"
                  "except ConfigError as e:\n    print(e)\n")
        env = {key: value for key, value in os.environ.items() if key != memory.BUDGET_ENV}
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
        assert out.returncode == 0, out.stderr[-3000:]
        assert re.search(r"needs [5-7]\.\d GiB of torch.float32 weights on each rank; only 1\.[0-4] GiB is available",
                         out.stdout), out.stdout
        assert f"(the memory limit in {group / 'memory.limit_in_bytes'})" in out.stdout, out.stdout
    finally:
        group.rmdir()  # the process has ended: the cgroup is empty


@pytest.mark.skipif(os.geteuid() != 0 or not (V1_MEMORY / "cgroup.procs").exists(),
                    reason="needs root and the cgroup v1 memory controller")
def test_a_float_model_its_cgroup_cannot_hold_is_refused_and_loads_quantized(smollm2_checkpoint):
    """The issue's run: one process in a memory cgroup of its idle size + 0.6 x the built-in model's float32 weights.
    `accessory generate` is refused by name (exit 2) before any weight is read (the cgroup's peak stays near the idle
    process), naming --quant int8 as what would fit; with --quant int4 in the same cgroup it loads and answers."""
    idle = int(subprocess.run([sys.executable, "-c", "import accessory.cli, accessory.model.meta\n"
                               "print(open('/proc/self/status').read().split('VmRSS:')[1].split()[0])"],
                              capture_output=True, text=True, check=True).stdout) * 1024
    weights = sum(p.stat().st_size for p in smollm2_checkpoint.glob("consolidated.*"))
    command = [sys.executable, "-m", "accessory", "generate", "--pretrained_path", str(smollm2_checkpoint),
               "--prompt", "The capital of France is", "--max_gen_len", "4"]
    env = {key: value for key, value in os.environ.items() if key != memory.BUDGET_ENV}
    for extra in ([], ["--quant", "int4"]):
        group = V1_MEMORY / f"accessory-test-{uuid.uuid4().hex[:8]}"
        group.mkdir()
        try:
            (group / "memory.limit_in_bytes").write_text(str(idle + weights * 6 // 10))
            enter = f"echo $$ > {group / 'cgroup.procs'} && exec \"$@\""
            run = subprocess.run(["sh", "-c", enter, "sh", *command, *extra], capture_output=True, text=True,
                                 timeout=600, env=env)
            peak = int((group / "memory.max_usage_in_bytes").read_text())
        finally:
            group.rmdir()
        if not extra:
            assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr[-3000:]
            assert re.search(r"needs 0\.5 GiB of torch.float32 weights on each rank; only 0\.\d GiB is available "
                             r"\(the memory limit in .*memory.limit_in_bytes\); --quant int8 \(0\.\d\d GiB", run.stderr)
            assert peak < idle + weights // 4, (peak, idle)  # no weight was read
        else:
            assert run.returncode == 0 and "Paris" in run.stdout, run.stderr[-3000:]
