"""Two machines, simulated on localhost: two `torchrun --nnodes=2 --node-rank=0|1 --master-addr --master-port`
launches, one per "node", joined over gloo, as docs/multinode.md tells users to run them. The oracle is the same
weights in one process."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from distributed import free_port
from test_batch import MAX_GEN_LEN, TINY_SEQ_LEN, oracle_outputs, read_jsonl, tiny_records, write_jsonl


def two_nodes(args: list[str], nproc_per_node: int, logs: Path, cwds: tuple = (None, None),
              timeout: int = 300) -> list[tuple[int, str, str]]:
    """`accessory ARGS` launched as node 0 and node 1 of a two-node torchrun job, each in its working directory
    `cwds[node]`; (status, stdout, stderr) of each."""
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")  # the interface the nodes reach each other on
    procs, files = [], []
    for node in (0, 1):
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={node}",
                   f"--nproc-per-node={nproc_per_node}", "--master-addr=127.0.0.1", f"--master-port={port}",
                   "-m", "accessory", *args]
        out, err = open(logs / f"node{node}.out", "w+"), open(logs / f"node{node}.err", "w+")  # no pipe to fill up
        files.append((out, err))
        procs.append(subprocess.Popen(command, stdout=out, stderr=err, env=env, cwd=cwds[node]))
    results = []
    for proc, (out, err) in zip(procs, files):
        status = proc.wait(timeout)
        out.seek(0), err.seek(0)
        results.append((status, out.read(), err.read()))
        out.close(), err.close()
    return results


def test_generate_across_two_nodes(tiny_checkpoints, tmp_path):
    """One process per node: the model-parallel group of 2 spans the nodes; node 0 holds rank 0 and prints."""
    prompt = "The story of the two machines"
    [expected] = oracle_outputs(tiny_checkpoints["mha", 1], [{"id": 0, "prompt": prompt}], MAX_GEN_LEN).values()
    results = two_nodes(["generate", "--pretrained_path", str(tiny_checkpoints["mha", 1]), "--prompt", prompt,
                         "--max_gen_len", str(MAX_GEN_LEN), "--max_seq_len", TINY_SEQ_LEN], 1, tmp_path)
    for node, (status, _, err) in enumerate(results):
        assert status == 0, f"node {node}: {err[-3000:]}"
    assert results[0][1] == expected + "\n"
    assert results[1][1] == ""  # only the source rank prints
    assert "at 2 model-parallel rank(s)" in results[0][2]


def test_batch_across_two_nodes(tiny_checkpoints, tmp_path):
    """Two processes per node and --mp 2: each node holds one whole model-parallel group (ranks 0-1 and 2-3), so
    only the data-parallel split crosses the network; both groups' parts land in the shared folder and merge."""
    records = tiny_records(10)
    oracle = oracle_outputs(tiny_checkpoints["mha", 1], records, MAX_GEN_LEN)
    output = tmp_path / "answers.jsonl"
    args = ["batch", "--pretrained_path", str(tiny_checkpoints["mha", 2]),
            "--input", str(write_jsonl(tmp_path / "in.jsonl", records)), "--output", str(output), "--mp", "2",
            "--batch_size", "2", "--max_gen_len", str(MAX_GEN_LEN), "--max_seq_len", TINY_SEQ_LEN]
    results = two_nodes(args, 2, tmp_path)
    for node, (status, _, err) in enumerate(results):
        assert status == 0, f"node {node}: {err[-3000:]}"
    rows = read_jsonl(output)
    assert [row["id"] for row in rows] == [r["id"] for r in records]
    assert {row["id"]: row["output"] for row in rows} == oracle
    assert "2 data-parallel x 2 model-parallel" in results[0][1] and results[1][1] == ""
    assert "straddle two nodes" not in results[0][2] + results[1][2]
    assert not list(tmp_path.glob("answers.jsonl.*"))


def test_batch_refuses_an_output_folder_a_node_cannot_see(tiny_checkpoints, tmp_path):
    """A relative --output resolved in a different working directory on node 1 stands for a disk only one machine
    sees: the group that cannot see rank 0's check file says so, and every rank stops before loading, instead of
    generating records the merge would never find."""
    (tmp_path / "node0").mkdir()
    (tmp_path / "node1").mkdir()
    args = ["batch", "--pretrained_path", str(tiny_checkpoints["mha", 1]),
            "--input", str(write_jsonl(tmp_path / "in.jsonl", tiny_records(4))), "--output", "out/answers.jsonl",
            "--max_gen_len", "4", "--max_seq_len", TINY_SEQ_LEN]
    results = two_nodes(args, 1, tmp_path, cwds=(tmp_path / "node0", tmp_path / "node1"))
    assert [status for status, _, _ in results] != [0, 0]
    errors = results[0][2] + results[1][2]
    assert f"data-parallel group 1 (on {socket.gethostname()}) does not see out/answers.jsonl.shared-check, which " \
           f"global rank 0 wrote: --output must be on a filesystem every machine shares" in errors, errors[-3000:]
    assert "loading weights" not in errors
    assert list((tmp_path / "node0" / "out").iterdir()) == []  # the check file is removed again
    assert not (tmp_path / "node1" / "out").exists()
