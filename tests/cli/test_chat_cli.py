"""`accessory chat` driven through a real pseudo-terminal, as a person types: two turns with the default model at
3 ranks under torchrun, /reset, and a clean end on Ctrl-D (every rank exits 0) and on Ctrl-C."""
from __future__ import annotations

import fcntl
import os
import pty
import select
import signal
import subprocess
import sys
import termios
import time

import pytest

from distributed import free_port

PROMPT = "user> "


class Terminal:
    """A command running on a pty that is its controlling terminal (so Ctrl-C and Ctrl-D behave as typed)."""

    def __init__(self, command: list[str], stderr_path):
        self.master, slave = pty.openpty()
        self.stderr = open(stderr_path, "w")
        self.stderr_path = stderr_path
        # PYTHONFAULTHANDLER: a program that hangs is aborted by `wait`, and prints every thread's stack first
        self.proc = subprocess.Popen(command, stdin=slave, stdout=slave, stderr=self.stderr, start_new_session=True,
                                     preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0),
                                     env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1"))
        os.close(slave)
        self.screen = ""

    def read_until(self, text: str, timeout: float = 240) -> str:
        """Everything printed from now until `text` appears (inclusive)."""
        start, deadline = len(self.screen), time.time() + timeout
        while text not in self.screen[start:]:
            assert time.time() < deadline, f"timed out waiting for {text!r}; screen:\n{self.screen}"
            if select.select([self.master], [], [], 1)[0]:
                try:
                    self.screen += os.read(self.master, 4096).decode(errors="replace")
                except OSError:  # the program ended and closed the terminal
                    assert text in self.screen[start:], f"ended before {text!r}; screen:\n{self.screen}"
        return self.screen[start: self.screen.index(text, start) + len(text)]

    def type(self, keys: str) -> None:
        os.write(self.master, keys.encode())

    def signal_state(self) -> str:
        """The program's signal masks and whether the terminal sends it Ctrl-C (its group in the foreground)."""
        status = open(f"/proc/{self.proc.pid}/status").read().splitlines()
        masks = ", ".join(line.replace("\t", " ") for line in status if line.startswith(("SigBlk", "SigIgn", "SigCgt")))
        return f"{masks}; terminal's foreground group {os.tcgetpgrp(self.master)}, its group {os.getpgid(self.proc.pid)}"

    def wait(self, timeout: float = 60) -> int:
        """The exit status; a program still running after `timeout` fails the test with its threads' stacks."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            state = self.signal_state()
            os.killpg(self.proc.pid, signal.SIGABRT)  # faulthandler writes each thread's stack to stderr
            self.proc.wait(30)
            self.stderr.flush()
            raise AssertionError(f"still running after {timeout} s ({state}); its stderr, stacks last:\n"
                                 f"{self.stderr_path.read_text()[-6000:]}") from None
        finally:
            os.close(self.master)
            self.stderr.close()


def chat_command(ranks: int | None) -> list[str]:
    args = ["-m", "accessory", "chat", "--max_gen_len", "48"]
    if ranks is None:
        return [sys.executable, *args]
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}", "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{free_port()}", *args]


def test_two_turns_at_three_ranks_then_ctrl_d(smollm2_checkpoint, tmp_path):
    term = Terminal(chat_command(3), tmp_path / "stderr.log")
    term.read_until(PROMPT)
    term.type("What is the capital of France?\n")
    first = term.read_until(PROMPT)
    assert "Paris" in first
    term.type("And what is the capital of Italy?\n")
    second = term.read_until(PROMPT)
    assert "Rome" in second, second  # the second turn sees the first (a follow-up question)
    term.type("/reset\n")
    assert "(new conversation)" in term.read_until(PROMPT)
    term.type("\x04")  # Ctrl-D
    assert term.wait() == 0, (tmp_path / "stderr.log").read_text()[-3000:]


def test_ctrl_c_at_the_prompt_ends_cleanly(smollm2_checkpoint, tmp_path):
    term = Terminal(chat_command(None), tmp_path / "stderr.log")
    term.read_until(PROMPT)
    term.type("\x03")  # Ctrl-C: 0 if it lands in the read, 130 (the shell's Ctrl-C status) if just before it
    assert term.wait() in (0, 130)
    assert "Traceback" not in (tmp_path / "stderr.log").read_text()


@pytest.mark.alone  # times the ranks' exit
def test_ctrl_c_under_torchrun_ends_every_rank(smollm2_checkpoint, tmp_path):
    """The terminal's Ctrl-C reaches torchrun and every rank: all end at once, no rank left waiting, and no rank
    prints a traceback (torchrun itself reports the signal)."""
    term = Terminal(chat_command(3), tmp_path / "stderr.log")
    term.read_until(PROMPT)
    time.sleep(1)
    term.type("\x03")
    start = time.time()
    assert term.wait(timeout=60) != 0
    assert time.time() - start < 30
    assert "accessory/cli/" not in (tmp_path / "stderr.log").read_text()
