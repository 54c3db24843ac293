"""Collectives through shared memory between the ranks of one machine (parallel/shared_memory.py,
kernels/collectives.c), against gloo's: every size and dtype the runtime sends, at 2, 3 and 4 ranks on 2 cores
(more ranks than cores), eager and compiled; the segment private and never left in /dev/shm; a rank killed with
SIGKILL in the middle of a collective ends the others with an error naming it; ranks in different collectives both
fail at once, naming them."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from distributed import free_port, run_ranks

SIZES = [1, 7, 576, 3 * 576 + 5, (1 << 18) + 3]  # the last: more than one slot of 1 MiB a rank (several rounds)
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int32, torch.int64]


def leftovers() -> list[str]:
    return sorted(p.name for p in Path("/dev/shm").glob("accessory-*"))


def against_gloo() -> dict:
    """Every collective of ParallelContext through the segment and through gloo, on random tensors seeded by rank."""
    import torch.distributed as dist

    from accessory.parallel import ParallelContext

    ctx = ParallelContext.from_group(None)
    assert ctx.local is not None, "no shared-memory segment on one machine"
    mismatches, sums = [], []
    for d, dtype in enumerate(DTYPES):
        for size in SIZES:
            every = [(torch.randn(size, generator=torch.Generator().manual_seed(1000 * r + 10 * d + size)) * 100)
                     .to(dtype) for r in range(ctx.world_size)]  # every rank's input, known to each
            x = every[ctx.rank]
            mine, theirs = ctx.all_reduce(x), x.clone()
            dist.all_reduce(theirs)
            exact = torch.stack([t.double() for t in every]).sum(0)
            scale = torch.stack([t.double().abs() for t in every]).sum(0)  # rounding grows with what is added
            eps = torch.finfo(dtype).eps if dtype.is_floating_point else 0.0
            for name, got in (("all_reduce", mine), ("gloo's all_reduce", theirs)):
                if got.dtype != dtype or ((got.double() - exact).abs() > 2 * eps * scale + 1e-12).any():
                    mismatches.append(f"{name} {dtype} {size}")
            sums.append(mine)
            parts = [torch.empty_like(x) for _ in range(ctx.world_size)]
            dist.all_gather(parts, x)
            if not torch.equal(ctx.all_gather(x[None], dim=0), torch.stack(parts)):
                mismatches.append(f"all_gather {dtype} {size}")
            gathered = ctx.gather_to_source(x[None], dim=0)
            if ctx.is_source and not torch.equal(gathered, torch.stack(parts)):
                mismatches.append(f"gather {dtype} {size}")
            if not ctx.is_source and gathered is not None:
                mismatches.append(f"gather {dtype} {size} returned on a rank other than the source")
            sent, expected = x.clone(), x.clone()
            dist.broadcast(expected, src=0)
            if not torch.equal(ctx.broadcast(sent), expected):
                mismatches.append(f"broadcast {dtype} {size}")
    obj = ctx.broadcast_object({"rank": ctx.rank, "text": "é" * 3000} if ctx.is_source else None)
    compiled = torch.compile(lambda t: ctx.all_reduce(t * 2) + 1, fullgraph=True)
    y = torch.arange(10, dtype=torch.float32) * (ctx.rank + 1)
    eager_step = ctx.all_reduce(y * 2) + 1
    maps = Path("/proc/self/maps").read_text()
    return {"mismatches": mismatches, "sums": sums, "obj": obj, "compiled": torch.equal(compiled(y), eager_step),
            "in /dev/shm": leftovers(), "mapped, unlinked": "/dev/shm/accessory-" in maps and "(deleted)" in maps}


@pytest.mark.parametrize("world", [2, 3, 4])
def test_every_collective_equals_gloo_at_2_3_and_4_ranks_eager_and_compiled(world):
    results = run_ranks(world, against_gloo)
    for rank, result in enumerate(results):
        assert not isinstance(result, Exception), result.rank_traceback
        assert result["mismatches"] == [], f"rank {rank}"
        assert all(torch.equal(mine, first) for mine, first in zip(result["sums"], results[0]["sums"])), \
            "every rank adds the slots in rank order: the same bits on each"
        assert result["obj"] == {"rank": 0, "text": "é" * 3000}
        assert result["compiled"], f"rank {rank}: the compiled step's all-reduce differs"
        assert result["mapped, unlinked"] and result["in /dev/shm"] == []
    assert leftovers() == []


def summing(value: float) -> tuple[bool, list[float]]:
    from accessory.parallel import ParallelContext

    ctx = ParallelContext.from_group(None)
    return ctx.local is not None, [float(ctx.all_reduce(torch.full((4,), value))[0]) for _ in range(200)]


def test_gloo_when_asked_and_two_jobs_never_share_a_segment():
    """ACCESSORY_TRANSPORT=gloo keeps gloo; two jobs at once each have their own segment (their sums are their own)."""
    os.environ["ACCESSORY_TRANSPORT"] = "gloo"
    try:
        assert run_ranks(2, summing, 1.0)[0] == (False, [2.0] * 200)
    finally:
        del os.environ["ACCESSORY_TRANSPORT"]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        first, second = pool.submit(run_ranks, 2, summing, 1.0), pool.submit(run_ranks, 2, summing, 5.0)
        assert first.result() == [(True, [2.0] * 200)] * 2
        assert second.result() == [(True, [10.0] * 200)] * 2


def making_a_context() -> tuple[str, str]:
    """What making the context raised (its class and message)."""
    from accessory.parallel import ParallelContext

    try:
        ParallelContext.from_group(None)
        return "nothing", ""
    except Exception as e:
        return type(e).__name__, str(e)


def test_an_unknown_transport_is_refused_by_name():
    """ACCESSORY_TRANSPORT=fast is a ConfigError (what the command line refuses with exit 2) naming the variable, its
    value and what it may be, on every rank."""
    os.environ["ACCESSORY_TRANSPORT"] = "fast"
    try:
        results = run_ranks(2, making_a_context)
    finally:
        del os.environ["ACCESSORY_TRANSPORT"]
    assert results == [("ConfigError", "ACCESSORY_TRANSPORT='fast': expected auto, shm or gloo")] * 2


def waiting_with_the_gil_held() -> int:
    """Rank 0 waits 2 s in a broadcast called with the GIL held (ctypes.PyDLL keeps it, as an AOTInductor package's
    run does); its other Python thread's beats meanwhile."""
    import ctypes
    import threading

    from accessory.kernels.build import library_path
    from accessory.parallel import ParallelContext

    ctx = ParallelContext.from_group(None)
    held = ctypes.PyDLL(str(library_path()))  # calls through it keep the GIL
    x = torch.zeros(4)
    beats, done = [0], threading.Event()

    def beat():
        while not done.is_set():
            beats[0] += 1
            time.sleep(0.01)

    thread = threading.Thread(target=beat)
    thread.start()
    if ctx.rank == 1:
        time.sleep(2.0)
    before = beats[0]
    held.accessory_shm_broadcast(ctx.local.handle, ctypes.c_void_p(x.data_ptr()), ctypes.c_int64(x.nbytes), 0,
                                 ctypes.c_double(0.0))
    during = beats[0] - before
    done.set()
    thread.join()
    return during


def test_a_rank_waiting_with_the_gil_held_lets_its_other_threads_run():
    """A rank that waits in a collective called with the GIL held (an AOTInductor package's step does) lets go of it
    while it sleeps: its watchdog's heartbeat goes on, so a long wait for a rank still compiling its package does not
    get it taken for frozen (it was, at 3 ranks on 2 cores: killed after --rank-timeout)."""
    results = run_ranks(2, waiting_with_the_gil_held)
    assert not isinstance(results[0], Exception), results[0].rank_traceback
    assert results[0] > 50, f"{results[0]} beats in 2 s: the waiting rank kept the GIL"


def waiting_for_a_late_rank() -> tuple[float, float]:
    """Rank 1 comes 0.3 s late to an all-reduce: (seconds this rank waited in it, seconds in the next, in step)."""
    from accessory.parallel import ParallelContext

    ctx = ParallelContext.from_group(None)
    start = ctx.local.waited_s
    if ctx.rank == 1:
        time.sleep(0.3)
    ctx.all_reduce(torch.ones(576))
    late = ctx.local.waited_s - start
    ctx.barrier()
    start = ctx.local.waited_s
    ctx.all_reduce(torch.ones(576))
    return late, ctx.local.waited_s - start


def test_the_time_a_rank_waits_for_the_others_is_counted():
    """benchmarks/parallel.py reports each rank's share of a step spent waiting: the early rank's count grows by
    about the other's lateness, the late rank's barely."""
    (early, _), (late, in_step) = run_ranks(2, waiting_for_a_late_rank)
    assert 0.25 < early < 1.0 and late < 0.1 and in_step < 0.1, (early, late, in_step)


def in_different_collectives() -> tuple[str, str, float]:
    """Rank 0 broadcasts a count while rank 1 all-reduces a step's activations (calls gone out of step): what each
    raised, and its message, and then whether the ranks still sum alike once back in step through gloo."""
    import torch.distributed as dist

    from accessory.parallel import ParallelContext

    ctx = ParallelContext.from_group(None)
    try:
        if ctx.rank == 0:
            ctx.broadcast(torch.tensor([5]))
        else:
            ctx.sum_in_step(torch.ones(576))
        raised = ("nothing", "")
    except Exception as e:
        raised = (type(e).__name__, str(e))
    x = torch.ones(3)
    dist.all_reduce(x)
    return raised + (float(x[0]),)


def test_ranks_in_different_collectives_both_fail_at_once_naming_both():
    """Every round carries what its collective is: ranks whose calls went out of step raise CollectivesOutOfStep
    (a RanksDisagree) at their first collective that differs, each naming both (gloo would sum or wait instead)."""
    for rank, result in enumerate(run_ranks(2, in_different_collectives)):
        assert not isinstance(result, Exception), result.rank_traceback
        kind, message, summed = result
        assert kind == "CollectivesOutOfStep", (rank, kind, message)
        assert ("not in the same collective" in message and "a broadcast of 8 bytes from rank 0" in message
                and "an all-reduce of 2304 float32" in message), message
        assert summed == 2.0


KILLED_SCRIPT = """
import os, signal, sys, time, torch, torch.distributed as dist
dist.init_process_group("gloo")
from accessory.parallel import ParallelContext
ctx = ParallelContext.from_group(None)
assert ctx.local is not None
x = torch.ones(576)
for step in range(10 ** 9):
    if ctx.rank == 1 and step == 300:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        ctx.all_reduce(x)
    except RuntimeError as e:
        print(f"rank {ctx.rank} after {step} steps: {e}", flush=True)
        sys.exit(7)
"""


def test_a_rank_killed_mid_collective_ends_the_others_naming_it_and_leaves_nothing_in_dev_shm(tmp_path):
    """Plain processes (torchrun would end the others itself): rank 1 kills itself among all-reduces; ranks 0 and 2
    stop with an error naming it, at once, and /dev/shm holds nothing of the job."""
    script = tmp_path / "killed.py"
    script.write_text(KILLED_SCRIPT)
    port, started = free_port(), time.monotonic()
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "3",
           "OMP_NUM_THREADS": "1"}
    ranks = [subprocess.Popen([sys.executable, str(script)], env={**env, "RANK": str(rank)}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for rank in range(3)]
    outputs = [rank.communicate(timeout=120) for rank in ranks]
    assert ranks[1].returncode == -signal.SIGKILL
    for rank in (0, 2):
        assert ranks[rank].returncode == 7, outputs[rank][1][-2000:]
        assert "model-parallel rank 1 (pid" in outputs[rank][0] and "ended" in outputs[rank][0], outputs[rank][0]
    assert time.monotonic() - started < 60
    assert leftovers() == []
