"""Run a function on several CPU ranks (gloo, one thread each) and collect what each rank returns."""
from __future__ import annotations

import multiprocessing
import os
import pickle
import socket
import sys
import tempfile
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# The ranks are forked from a forkserver that has imported these once (it never runs torch code itself, so the fork
# is clean): a spawned rank spent about a second of this machine's 2 cores importing them, for each rank of each
# run. Every rank is still a process of its own with its own gloo group, as under torchrun.
PRELOAD = ["torch", "torch.distributed", "numpy", "pytest", "accessory.model.meta", "accessory.generation.scheduler",
           "accessory.generation.sampling", "distributed", "tiny"]
multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(world: int, fn, *args) -> list:
    """fn(*args) on `world` ranks of one gloo group; returns the ranks' results in rank order.

    A rank's exception is returned as the exception object (with its traceback text in `.rank_traceback`), so a
    test can check the message every rank raised. What the ranks print goes to this process's stderr (the test's
    captured output) once they have ended.
    """
    with tempfile.TemporaryDirectory() as out:
        try:
            mp.start_processes(_rank_main, args=(world, free_port(), out, dict(os.environ), fn, args), nprocs=world,
                               join=True, start_method="forkserver")
        finally:
            for rank in range(world):
                log = Path(out, f"{rank}.log")
                if log.exists() and log.stat().st_size:
                    sys.stderr.write(f"---- rank {rank} of {world} ----\n{log.read_text(errors='replace')}")
        return [pickle.loads(Path(out, f"{rank}.pkl").read_bytes()) for rank in range(world)]


def _rank_main(rank: int, world: int, port: int, out: str, environ: dict, fn, args) -> None:
    # a forked rank has the forkserver's environment and output: take the caller's, and write to a log it shows
    os.environ.clear()
    os.environ.update(environ)
    log = os.open(Path(out, f"{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    for fd in (1, 2):
        os.dup2(log, fd)
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = fn(*args)
    except Exception as e:  # returned, not raised: the test asserts on it
        e.rank_traceback = traceback.format_exc()
        result = e
    try:
        payload = pickle.dumps(result)
    except Exception as e:
        payload = pickle.dumps(RuntimeError(f"unpicklable result on rank {rank}: {e!r}"))
    Path(out, f"{rank}.pkl").write_bytes(payload)
    dist.barrier()  # without it gloo may abort at exit
    dist.destroy_process_group()
