"""A live `accessory serve` for the tests: the built-in model at 3 ranks under torchrun (or what `extra_args` and
`nproc` say), and the helpers that ask it (the conftest's `server` fixture starts one and shares it); and a service
running in the test's own process (`running`), for an app in a TestClient."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import httpx
import openai

from conftest import REPO
from distributed import free_port

KEY = "test-key-123"
MODEL = "SmolLM2-135M-Instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


class Server:
    def __init__(self, tmp_path, *extra_args: str, nproc: int = 3):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp_path / "serve.log"
        self.log = open(self.log_path, "w")
        command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--rdzv-backend=c10d",
                   f"--rdzv-endpoint=127.0.0.1:{free_port()}", "-m", "accessory", "serve", "--port", str(self.port),
                   "--api-key", KEY, "--max_seq_len", "512", "--max_batch_size", "8", "--shutdown-grace", "60",
                   *extra_args]
        self.proc = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env=dict(os.environ, OMP_NUM_THREADS="1"))

    def wait_ready(self, timeout: float = 300) -> None:
        deadline = time.time() + timeout
        self.statuses = []  # what /health said meanwhile
        while time.time() < deadline:
            assert self.proc.poll() is None, f"server exited {self.proc.returncode}:\n{self.read_log()}"
            try:
                answer = httpx.get(f"{self.url}/health", timeout=2)
                self.statuses.append((answer.status_code, answer.json().get("status"), answer.json().get("phase")))
                if answer.status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise AssertionError(f"server not ready after {timeout} s:\n{self.read_log()}")

    def read_log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_line(self, text: str, timeout: float = 10) -> str:
        """The first line of the log holding `text`, waiting for it: a request's summary line is written as the
        request ends, which can come just after its response reached the client."""
        deadline = time.time() + timeout
        while True:
            line = next((line for line in self.read_log().splitlines() if text in line), None)
            if line is not None:
                return line
            assert time.time() < deadline, f"no log line with {text!r} after {timeout} s:\n{self.read_log()[-3000:]}"
            time.sleep(0.05)

    def health(self) -> dict:
        return httpx.get(f"{self.url}/health", timeout=10).json()

    def client(self, key: str = KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0, timeout=180)

    def workers(self) -> list[int]:
        out = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True).stdout
        return [int(pid) for pid in out.split()]

    def worker_of_rank(self, rank: int) -> int:
        return next(pid for pid in self.workers() if rank_of(pid) == rank)

    def stop(self) -> None:
        if self.proc.poll() is None:
            for pid in self.workers():  # torchrun starts each worker in a session of its own
                os.kill(pid, signal.SIGKILL)
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.log.close()


def rank_of(pid: int) -> int:
    """The RANK torchrun gave a worker process."""
    environ = dict(item.split("=", 1) for item in open(f"/proc/{pid}/environ").read().split("\0") if "=" in item)
    return int(environ["RANK"])


def chat(client, messages=QUESTION, **options):
    options.setdefault("temperature", 0)
    return client.chat.completions.create(model=MODEL, messages=messages, **options)


def streamed_text(stream, chat_chunks: bool = True) -> tuple[str, list[str], str]:
    """(joined text, the pieces, finish_reason) of a stream."""
    pieces, finish = [], None
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        piece = (choice.delta.content if chat_chunks else choice.text) or ""
        if piece:
            pieces.append(piece)
        finish = choice.finish_reason or finish
    return "".join(pieces), pieces, finish


@contextmanager
def running(checkpoint, template: str):
    """A running service on the built-in model with tests/data/chat_templates/`template`.jinja."""
    from accessory.model.meta import MetaModel
    from accessory.serve.service import GenerationService

    model = MetaModel.from_pretrained(checkpoint, max_seq_len=512)
    model.tokenizer.set_chat_template(REPO / f"tests/data/chat_templates/{template}.jinja")
    service = GenerationService(model, heartbeat_s=0.2)
    runner = threading.Thread(target=service.run, daemon=True)
    runner.start()
    try:
        yield service
    finally:
        service.shutdown()
        runner.join(timeout=30)


@contextmanager
def app_client(service, **options):
    """A TestClient of the API app over `service` (create_app's `options`)."""
    from starlette.testclient import TestClient

    from accessory.serve.api import create_app

    with TestClient(create_app(service, "smol", **options)) as client:
        yield client
