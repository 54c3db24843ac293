"""Run a function on several CPU ranks (gloo, one thread each) and collect what each rank returns."""
from __future__ import annotations

import os
import pickle
import socket
import tempfile
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(world: int, fn, *args) -> list:
    """fn(*args) on `world` ranks of one gloo group; returns the ranks' results in rank order.

    A rank's exception is returned as the exception object (with its traceback text in `.rank_traceback`), so a
    test can check the message every rank raised.
    """
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_rank_main, args=(world, free_port(), out, fn, args), nprocs=world, join=True,
                           start_method="spawn")
        return [pickle.loads(Path(out, f"{rank}.pkl").read_bytes()) for rank in range(world)]


def _rank_main(rank: int, world: int, port: int, out: str, fn, args) -> None:
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
