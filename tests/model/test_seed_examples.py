"""LLaMA2-Accessory's inference examples, as its documentation writes them, run as a user runs them on this machine
(tests/seed_examples.py, tests/seed_mp_example.py say what was changed for the CPU): the pretrained, alpaca and
multi-turn examples (the EITHER loop, and the OR loop that breaks out of the stream, twice, then a generate) in one
script at 1 rank and under torchrun at 3; the multi-GPU example (mp.Process, spawn, its own process group, no
barrier at the end) at 1 and 3 ranks. Every rank's results equal a single process's; every process exits 0."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from distributed import free_port
from conftest import TESTS

ENV = dict(os.environ, OMP_NUM_THREADS="1")


def results_of(out: Path, ranks: int) -> list:
    return [json.loads((out / f"{rank}.json").read_text()) for rank in range(ranks)]


def run_script(command: list[str], out: Path, ranks: int) -> list:
    out.mkdir()
    run = subprocess.run(command, capture_output=True, text=True, timeout=600, env=ENV)
    assert run.returncode == 0 and "Traceback" not in run.stderr, run.stderr[-4000:]
    return results_of(out, ranks)


def seed_examples(checkpoint, out: Path, ranks: int) -> list:
    launcher = ([sys.executable] if ranks == 1 else
                [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}", "--rdzv-backend=c10d",
                 f"--rdzv-endpoint=127.0.0.1:{free_port()}"])
    return run_script(launcher + [str(TESTS / "seed_examples.py"), str(checkpoint), str(out)], out, ranks)


@pytest.fixture(scope="module")
def single(smollm2_checkpoint, tmp_path_factory):
    return seed_examples(smollm2_checkpoint, tmp_path_factory.mktemp("seed") / "out", 1)[0]


def test_the_examples_at_one_rank(single):
    assert single["pretrained generate"] == single["pretrained stream"] and single["pretrained stream"].strip()
    assert single["alpaca generate"] == single["alpaca stream"] and single["alpaca stream"].strip()
    assert single["multi-turn prompt"] == (
        "A chat between a curious human and an artificial intelligence assistant. The assistant gives helpful, "
        "detailed, and polite answers to the human's questions.\n\n"
        "### Human: What's the best programming language in the world?\n"
        "### Assistant: The best programming language in the world in PHP.\n"
        "### Human: Are you sure? Why not Python?\n"
        "### Assistant:")
    assert "###" not in single["EITHER"] and single["EITHER"].strip()
    first, again = single["OR '.'"]
    assert first == again and first.strip() and "." not in first  # it broke out at the separator, twice alike
    assert single["generate after"].strip()
    events = single["events"]
    assert len(events) > 3 and events[-1][2:] == [True, "length", 6]


def test_the_examples_under_torchrun_at_three_ranks_see_what_one_process_sees(smollm2_checkpoint, single,
                                                                               tmp_path):
    for rank, result in enumerate(seed_examples(smollm2_checkpoint, tmp_path / "out", 3)):
        assert result == single, f"rank {rank} of 3 saw other results than a single process"


@pytest.mark.parametrize("ranks", [1, 3])
def test_the_multi_gpu_example_with_mp_process(smollm2_checkpoint, single, tmp_path, ranks):
    command = [sys.executable, str(TESTS / "seed_mp_example.py"), str(smollm2_checkpoint), str(tmp_path / "out"),
               str(ranks), str(free_port())]
    streams = run_script(command, tmp_path / "out", ranks)
    assert all(stream == streams[0] for stream in streams), "the ranks streamed different texts"
    assert len(streams[0]) > 3 and streams[0][-1] == single["alpaca stream"]
