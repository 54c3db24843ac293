"""A rank that stops answering is found: SIGSTOP of a non-source rank during a stream (the server), during `generate`
and during `batch` ends every process within --rank-timeout + 10 s and names the rank; the stream's client gets an
error event, as it does when a rank is SIGKILLed; SIGKILL of the source or the last rank during `generate` ends every
process too; `batch` resumes on a rerun; an idle server with a short timeout keeps serving."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from distributed import free_port
from serving import KEY, MODEL, QUESTION, Server, rank_of

TIMEOUT_S = 6
pytestmark = pytest.mark.alone  # every test times the ranks against TIMEOUT_S


def gone_within(proc: subprocess.Popen, pids: list[int], seconds: float) -> bool:
    """Whether torchrun and every worker have exited within `seconds`."""
    deadline = time.time() + seconds
    while time.time() < deadline:
        if proc.poll() is not None and not any(os.path.exists(f"/proc/{pid}") and not _zombie(pid) for pid in pids):
            return True
        time.sleep(0.2)
    return False


def _zombie(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().split(")")[-1].split()[0] == "Z"
    except OSError:
        return False


def _kill_quietly(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def start_long_stream(server: Server) -> tuple[list[str], threading.Thread]:
    """A long streamed chat request, read in a thread; returns once its first event has arrived."""
    events, first = [], threading.Event()

    def read_stream():
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Write a very long story."}],
                "max_tokens": 450, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=120,
                          headers={"Authorization": f"Bearer {KEY}"}) as answer:
            for line in answer.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    first.set()

    reader = threading.Thread(target=read_stream, daemon=True)
    reader.start()
    assert first.wait(60)
    return events, reader


def test_an_idle_server_keeps_serving_and_a_frozen_rank_ends_every_rank_with_an_error_event(tmp_path,
                                                                                        smollm2_checkpoint):
    server = Server(tmp_path, "--rank-timeout", str(TIMEOUT_S))
    try:
        server.wait_ready()
        time.sleep(TIMEOUT_S * 1.5)  # idle for longer than the timeout: nothing trips
        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
        assert "Paris" in server.client().chat.completions.create(model=MODEL, messages=QUESTION, temperature=0,
                                                                   max_tokens=6).choices[0].message.content
        workers = server.workers()
        events, reader = start_long_stream(server)
        frozen = server.worker_of_rank(1)
        os.kill(frozen, signal.SIGSTOP)
        stopped_at = time.time()
        health = None
        while time.time() < stopped_at + TIMEOUT_S:
            health = httpx.get(f"{server.url}/health", timeout=5)
            if health.status_code == 503:
                break
            time.sleep(0.3)
        assert health.status_code == 503 and health.json()["status"] == "stalled", health.text
        assert "1" in health.json()["silent_ranks"]
        assert gone_within(server.proc, workers, TIMEOUT_S + 10), server.read_log()[-3000:]
        reader.join(timeout=10)
        assert events[-1] == "[DONE]" and "rank 1 has not answered" in json.loads(events[-2])["error"]["message"]
        assert server.proc.returncode != 0
        log = server.read_log()
        assert "rank 1 has not answered" in log
        # rank 0's collective failed first (rank 2's watchdog killed rank 1), yet it ends as documented: status 3
        # from its watchdog, not 1 with a traceback (torchrun's summary names each rank's status)
        assert "[rank0]: Traceback" not in log and re.search(r"rank +: 0 \(local_rank: 0\)\n +exitcode +: 3 ", log), \
            log[-3000:]
    finally:
        server.stop()


@pytest.mark.parametrize("ranks, pp, stop, rank", [(3, 1, signal.SIGSTOP, 2), (3, 1, signal.SIGKILL, 0),
                                                  (3, 1, signal.SIGKILL, 2), (2, 2, signal.SIGSTOP, 1),
                                                  (2, 2, signal.SIGKILL, 1)],
                         ids=["frozen-2", "killed-0", "killed-2", "pp2-frozen-stage-1", "pp2-killed-stage-1"])
def test_a_frozen_or_killed_rank_during_generate_ends_every_rank(tmp_path, smollm2_checkpoint, ranks, pp, stop,
                                                                 rank):
    """(pp2: two pipeline stages; a frozen stage is named as one.)"""
    log_path = tmp_path / "generate.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}", "--rdzv-backend=c10d",
             f"--rdzv-endpoint=127.0.0.1:{free_port()}", "-m", "accessory", "generate", "--prompt", "Tell a story.",
             "--max_gen_len", "2000", "--max_seq_len", "2048", "--rank-timeout", str(TIMEOUT_S), "--pp", str(pp)],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    workers = []
    try:
        deadline = time.time() + 120
        while "loaded" not in log_path.read_text() and time.time() < deadline:
            assert proc.poll() is None, log_path.read_text()
            time.sleep(0.5)
        time.sleep(2)  # decoding
        workers = [int(p) for p in subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True,
                                                  text=True).stdout.split()]
        os.kill(next(pid for pid in workers if rank_of(pid) == rank), stop)
        assert gone_within(proc, workers, TIMEOUT_S + 10), log_path.read_text()[-3000:]
        assert proc.returncode != 0
        if stop == signal.SIGSTOP:  # a killed rank ends its peers' collectives at once; a frozen one is found
            named = f"rank {rank} (pipeline stage {rank} of {pp}" if pp > 1 else f"rank {rank} has not answered"
            assert named in log_path.read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for pid in workers:
            _kill_quietly(pid)


def test_a_killed_rank_ends_every_rank_and_the_stream_gets_an_error_event(tmp_path, smollm2_checkpoint):
    server = Server(tmp_path, "--rank-timeout", str(TIMEOUT_S))
    try:
        server.wait_ready()
        workers = server.workers()
        events, reader = start_long_stream(server)
        os.kill(server.worker_of_rank(2), signal.SIGKILL)
        assert gone_within(server.proc, workers, TIMEOUT_S + 10), server.read_log()[-3000:]
        reader.join(timeout=10)
        assert events[-1] == "[DONE]" and "generation failed" in json.loads(events[-2])["error"]["message"]
        assert server.proc.returncode != 0
    finally:
        server.stop()


@pytest.mark.parametrize("stop", [signal.SIGSTOP], ids=["frozen"])  # a killed job resuming: test_batch.py
def test_a_frozen_or_killed_rank_during_batch_ends_it_and_the_rerun_resumes(tiny_checkpoints, tmp_path, stop):
    from test_batch import batch_command, lines_in_parts, read_jsonl, tiny_records, write_jsonl

    records = tiny_records(40)  # 10 batches of 4: the rank is stopped after the first (the rerun makes the rest)
    source = write_jsonl(tmp_path / "in.jsonl", records)
    output = tmp_path / "out" / "answers.jsonl"
    args = ["--pretrained_path", str(tiny_checkpoints["mha", 2]), "--input", str(source), "--output", str(output),
            "--mp", "2", "--batch_size", "4", "--max_gen_len", "24", "--max_seq_len", "256",
            "--rank-timeout", str(TIMEOUT_S)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    first = subprocess.Popen(batch_command(args, nproc=2), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             env=env, start_new_session=True)
    workers = []
    try:
        deadline = time.time() + 240
        while lines_in_parts(output) < 4 and first.poll() is None and time.time() < deadline:
            time.sleep(0.01)
        workers = [int(p) for p in subprocess.run(["pgrep", "-P", str(first.pid)], capture_output=True,
                                                  text=True).stdout.split()]
        os.kill(next(pid for pid in workers if rank_of(pid) == 1), stop)
        assert gone_within(first, workers, TIMEOUT_S + 10)
        log = first.stderr.read().decode()
        assert first.returncode != 0, log[-3000:]
        assert stop == signal.SIGKILL or "rank 1 has not answered" in log, log[-3000:]
        assert not output.exists() and 4 <= lines_in_parts(output) < len(records)
    finally:  # nothing left behind on a failure: torchrun, and a stopped worker it may have left
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
            first.wait()
        for pid in workers:
            _kill_quietly(pid)
    rerun = subprocess.run(batch_command(args, nproc=2), capture_output=True, text=True, timeout=600, env=env)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert [row["id"] for row in read_jsonl(output)] == [r["id"] for r in records]
