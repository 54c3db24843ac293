"""The model-parallel group a model runs on, and the few collectives the runtime needs.

The group is passed explicitly (never stored in a module global), so one process can hold several models on
different groups. A single process with no process group is a group of one: every collective is then a no-op.
"""
from __future__ import annotations

import atexit
import datetime
import functools
import logging
import os
import pickle
import sys
import time
from pathlib import Path
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from accessory.errors import CollectivesOutOfStep, ConfigError, RanksDisagree
from accessory.parallel.links import BROADCAST, GATHER, SUM, Link, close_links, connect
from accessory.parallel.shared_memory import (OUT_OF_STEP, SharedMemoryGroup, group_timeout_s, for_group, forget_groups,
                                              ranks_and_cores)
from accessory.parallel.watchdog import announced_failure, stop_watchdog

log = logging.getLogger(__name__)

STAR_BYTES = 1 << 16  # messages up to this size go point to point through the source rank (`ParallelContext.star`)
ANNOUNCEMENT_S = 3.0  # how long a rank whose peer closed its connection waits for that peer to say why


def init_distributed(timeout_s: float = 600.0) -> None:
    """Join the process group torchrun describes (RANK/WORLD_SIZE/MASTER_ADDR in the environment), once.

    NCCL when CUDA is available, gloo otherwise. Without torchrun's variables this does nothing: the process runs
    as a model-parallel group of one.
    """
    if dist.is_initialized() or "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    log.debug("joined process group: rank %d of %d (%s)", dist.get_rank(), dist.get_world_size(), backend)


@functools.cache
def share_cores() -> int:
    """Under torchrun, this rank's threads: its share of the machine's cores, cores // (ranks on this machine), at
    least 1, unless OMP_NUM_THREADS was set for the job. torchrun sets OMP_NUM_THREADS=1 for its workers when the
    job did not (one core each of however many): that is not taken for a choice. Once a process; logged."""
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if local is None or _threads_chosen():
        return torch.get_num_threads()
    cores = len(os.sched_getaffinity(0))
    threads = max(1, cores // int(local))
    torch.set_num_threads(threads)
    log.info("%d thread(s) on this rank: %d cores on this machine for its %s ranks (OMP_NUM_THREADS chooses)",
             threads, cores, local)
    return threads


def warn_if_ranks_crowd_cores(ctx: ParallelContext) -> None:
    """Said once, by the first rank, where a model-parallel group has more ranks on this machine than it has cores:
    they take turns on the cores at every collective, and every rank runs an eager step's whole Python, so eager
    decoding is slower than one rank there (benchmarks/README.md, `parallel.py`, fifth session)."""
    if ctx.world_size == 1:
        return
    ranks, cores = ranks_and_cores()
    if ranks > cores and ctx.rank == 0:
        log.warning("%d ranks share this machine's %d cores: they take turns on them at every collective, so eager "
                    "decoding here is slower than one rank; compile=True (--compile) decodes faster, or run at most "
                    "%d ranks a machine", ranks, cores, cores)


def _threads_chosen() -> bool:
    """Whether OMP_NUM_THREADS was set for the job, not by torchrun for its workers (then the launcher, this
    process's parent, started without it)."""
    if "OMP_NUM_THREADS" not in os.environ:
        return False
    try:
        launcher = Path(f"/proc/{os.getppid()}/environ").read_bytes().split(b"\0")
    except OSError:
        return True
    return "TORCHELASTIC_RUN_ID" not in os.environ or any(v.startswith(b"OMP_NUM_THREADS=") for v in launcher)


def fairscale_model_parallel_group() -> Optional[dist.ProcessGroup]:
    """fairscale's model-parallel group, when this process set one up as LLaMA2-Accessory's scripts do
    (`fairscale.nn.model_parallel.initialize.initialize_model_parallel(n)`); else None.

    fairscale is not a dependency, and nothing is imported here: a group can only have been set up if that module
    is already imported."""
    fs_init = sys.modules.get("fairscale.nn.model_parallel.initialize")
    if fs_init is None or not dist.is_initialized() or not fs_init.model_parallel_is_initialized():
        return None
    return fs_init.get_model_parallel_group()


def shutdown_distributed(timeout_s: Optional[float] = None) -> None:
    """Leave the process group cleanly: a barrier first, because gloo may abort at exit without one. `timeout_s`:
    the longest to wait there for the other ranks (gloo; NCCL waits the group's own timeout)."""
    if dist.is_initialized():
        if timeout_s is not None and dist.get_backend() == "gloo":
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=timeout_s))
        else:
            dist.barrier()
        stop_watchdog()  # after the barrier: every rank is here, none may go silent while another still waits
        forget_groups()
        close_links()
        dist.destroy_process_group()


def leave_distributed() -> None:
    """Leave the process group without a barrier: after a failure the other ranks may be elsewhere, and a barrier
    could hang (torchrun ends the rest)."""
    if dist.is_initialized():
        forget_groups()
        close_links()
        dist.destroy_process_group()


def world_rank() -> int:
    """This process's rank in the whole world (0 without a process group)."""
    return dist.get_rank() if dist.is_initialized() else 0


def world_barrier() -> None:
    """Every process of the world waits here (nothing without a process group)."""
    if dist.is_initialized():
        dist.barrier()


@functools.cache
def leave_at_exit(timeout_s: float) -> None:
    """Leave the process group cleanly at interpreter exit if the script has not (LLaMA2-Accessory's examples
    end without destroy_process_group, and gloo then aborts now and then at exit). Registered once a process."""
    atexit.register(_leave_quietly, timeout_s)


def _leave_quietly(timeout_s: float) -> None:
    if getattr(sys, "last_value", None) is not None:  # an uncaught exception ends this script: leave at once, so
        return  # the other ranks' collectives fail now, naming this rank, rather than after a barrier's timeout
    try:
        shutdown_distributed(timeout_s)
    except Exception as e:  # a rank that failed, or left without its barrier: nothing more to do at exit
        log.warning("could not leave the process group cleanly at exit: %s", e)


@dataclass(frozen=True)
class GroupLayout:
    """This rank's place in a world split as data-parallel x model-parallel: `dp_size` groups of `mp_size`
    consecutive global ranks, each group running its own copy of the model."""
    mp_group: Optional[dist.ProcessGroup]  # this rank's model-parallel group (None: a single process)
    dp_rank: int  # which model-parallel group this rank belongs to
    dp_size: int
    mp_size: int

    @property
    def mp_rank(self) -> int:
        return dist.get_rank(self.mp_group) if self.mp_group is not None else 0


def data_parallel_layout(mp_size: int) -> GroupLayout:
    """Split the world into groups of `mp_size` consecutive ranks: group g is global ranks [g*mp, (g+1)*mp).

    Collective: every rank must call it, in the same order relative to other group creation, because
    `dist.new_group` is collective over the whole world even for ranks outside the new group. Consecutive ranks,
    because torchrun numbers a node's processes consecutively: when `mp_size` divides the processes per node, the
    tensor-parallel all-reduces of each group stay inside one node and only the data-parallel split crosses nodes.
    """
    world = dist.get_world_size() if dist.is_initialized() else 1
    if mp_size < 1 or world % mp_size:
        raise ConfigError(f"model-parallel size {mp_size} must divide the world size {world} (world = data-parallel x "
                         f"model-parallel); launch a multiple of {mp_size} processes")
    if not dist.is_initialized():
        return GroupLayout(None, 0, 1, 1)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if local % mp_size and mp_size % local:  # a group of whole nodes (mp a multiple of local) is a deliberate choice
        log.warning("model-parallel size %d and %d processes per node do not nest: some model-parallel groups "
                    "straddle two nodes, and every layer's all-reduce crosses the network", mp_size, local)
    rank = dist.get_rank()
    mine = None
    for start in range(0, world, mp_size):
        ranks = list(range(start, start + mp_size))
        group = dist.group.WORLD if mp_size == world else dist.new_group(ranks)
        if rank in ranks:
            mine = group
    return GroupLayout(mine, rank // mp_size, world // mp_size, mp_size)


@dataclass(frozen=True)
class ParallelContext:
    group: Optional[dist.ProcessGroup]  # None: a single process, no collectives
    rank: int  # rank inside the model-parallel group
    world_size: int  # model-parallel size
    src: int  # global rank of model-parallel rank 0: the rank that owns I/O with the user
    timeout_s: float = 60.0  # the longest a rank waits for the others at a generation step (`sum_in_step`)
    # the group's shared-memory segment when all its ranks are on this machine (parallel/shared_memory.py): then
    # every collective below but the object ones goes through it, else through the process group
    local: Optional[SharedMemoryGroup] = field(default=None, compare=False, repr=False)
    # where collectives' tensors must live for the group's backend. gloo's are in host memory: CUDA tensors (ranks
    # sharing one GPU, which NCCL refuses) go through a host copy, since the shared-memory transport reads host
    # addresses and gloo's own CUDA paths crashed a rank (benchmarks/README.md, "GPU")
    device: torch.device = field(default=torch.device("cpu"), compare=False, repr=False)
    # gloo without the segment (ranks on several machines): the engine's small messages (a step's header, sampling's
    # candidates) go point to point through the source rank over TCP connections of their own (links.py): a round
    # trip took 0.09 ms over a link between two machines, gloo's send and receive 0.53 ms (benchmarks/README.md,
    # "Links").
    # The source rank holds a link to every other rank, by group rank; every other rank one, to the source.
    links: Optional[dict[int, Link]] = field(default=None, compare=False, repr=False)

    @classmethod
    def from_group(cls, group: Optional[dist.ProcessGroup] = None, timeout_s: float = 60.0) -> "ParallelContext":
        """The given group, else the whole torchrun world, else a single process."""
        if not dist.is_initialized():
            if group is not None:
                raise RuntimeError("mp_group was given but torch.distributed is not initialized")
            return cls(None, 0, 1, 0, timeout_s)
        group = group or dist.group.WORLD
        world = dist.get_world_size(group)
        backend = dist.get_backend(group)
        local = for_group(group) if world > 1 and backend == "gloo" else None
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        rank = dist.get_rank(group)
        links = None
        if world > 1 and backend == "gloo" and local is None:
            links = connect(group, list(range(1, world)) if rank == 0 else [0], group_timeout_s(group))
        return cls(group, rank, world, dist.get_global_rank(group, 0), timeout_s, local, device, links)

    @classmethod
    def of_stage(cls, group: Optional[dist.ProcessGroup], whole: "ParallelContext") -> "ParallelContext":
        """A pipeline stage's tensor-parallel ranks (`group`; None: this rank alone), within `whole`'s group."""
        if group is None:
            return cls(None, 0, 1, dist.get_rank(), whole.timeout_s, device=whole.device)
        return cls.from_group(group, whole.timeout_s)

    @property
    def is_source(self) -> bool:
        return self.rank == 0

    @property
    def star(self) -> bool:
        """Whether the small messages go point to point through the source rank (`links`)."""
        return self.links is not None

    # The layers' collectives are functional (out of place), so a compiled decode step traces through them.

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's x."""
        if self.world_size == 1:
            return x
        if x.device != self.device:
            return self.all_reduce(x.to(self.device)).to(x.device)
        if self.local is not None:
            return self.local.all_reduce(x)
        return funcol.all_reduce(x, "sum", self.group)

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's x, concatenated along `dim` in rank order."""
        if self.world_size == 1:
            return x
        if x.device != self.device:
            return self.all_gather(x.to(self.device), dim).to(x.device)
        if self.local is not None:
            return torch.cat(self.local.all_gather(x).unbind(0), dim=dim)
        if torch.compiler.is_compiling():
            # Inductor lowers all_reduce itself but calls all_gather through a Python fallback, which its C++
            # wrapper (the compiled step's on the CPU) cannot emit: sum the slices placed in zeros, the same values.
            parts = [torch.zeros_like(x)] * self.world_size
            parts[self.rank] = x
            return funcol.all_reduce(torch.cat(parts, dim=dim), "sum", self.group)
        if self.star and x.nbytes <= STAR_BYTES:
            stacked = (self.world_size * x.shape[0], *x.shape[1:])
            return torch.cat(self._star(x, torch.cat, stacked, GATHER).chunk(self.world_size), dim=dim)
        # all_gather_tensor, not all_gather_single: torch 2.11 (CUDA 13 wheels) has only the former
        gathered = funcol.all_gather_tensor(x.contiguous(), 0, self.group)  # the ranks' x stacked on dim 0
        return torch.cat(gathered.chunk(self.world_size, dim=0), dim=dim)

    def gather_to_source(self, x: torch.Tensor, dim: int = -1) -> Optional[torch.Tensor]:
        """Every rank's x concatenated along `dim` on the source rank; None elsewhere (the engine's logits: only
        the source rank samples, so only it needs the whole vocabulary)."""
        if self.world_size == 1:
            return x
        if x.device != self.device:
            whole = self.gather_to_source(x.to(self.device), dim)
            return whole.to(x.device) if whole is not None else None
        if self.local is not None:
            with _peer_failures_named():
                parts = self.local.gather(x, 0)
            return torch.cat(parts.unbind(0), dim=dim) if parts is not None else None
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)] if self.is_source else None
        with _peer_failures_named():
            if self.star and x.nbytes <= STAR_BYTES:  # each rank's message straight to the source
                if not self.is_source:
                    self.links[0].send(x, GATHER)
                    return None
                parts = [x] + [self.links[rank].receive(x.shape, x.dtype, GATHER)
                               for rank in range(1, self.world_size)]
            else:
                dist.gather(x, parts, dst=self.src, group=self.group)
        return torch.cat(parts, dim=dim) if self.is_source else None

    def sum_in_step(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's x (in place), waiting at most `timeout_s` for the other ranks (on gloo; NCCL
        applies the process group's own timeout). Raises TimeoutError if they do not all come, CollectivesOutOfStep
        if (through shared memory) some are in another collective."""
        if self.world_size > 1 and x.device != self.device:
            return x.copy_(self.sum_in_step(x.to(self.device)))
        if self.world_size > 1 and self.local is not None:
            try:
                with _peer_failures_named():
                    return x.copy_(self.local.all_reduce(x, self.timeout_s))
            except RuntimeError as e:
                if "timed out" not in str(e):
                    raise
                raise TimeoutError(f"the other ranks did not join within {self.timeout_s:g} s") from None
        if self.world_size > 1 and self.star and x.nbytes <= STAR_BYTES:
            return x.copy_(self._star(x, lambda parts: torch.stack(parts).sum(0), x.shape, SUM, self.timeout_s))
        if self.world_size > 1:
            work = dist.all_reduce(x, group=self.group, async_op=True)
            try:
                with _peer_failures_named():
                    work.wait(timeout=datetime.timedelta(seconds=self.timeout_s))
            except RuntimeError as e:
                if "timed out" not in str(e).lower():
                    raise
                raise TimeoutError(f"the other ranks did not join within {self.timeout_s:g} s") from None
        return x

    def sum_started(self, x: torch.Tensor) -> Optional[Callable[[], torch.Tensor]]:
        """`sum_in_step(x)` started ahead on a rank other than the source, where it goes point to point (`star`): x
        is sent now, and calling what this returns waits for the sum (TimeoutError as sum_in_step). None where the
        sum cannot start ahead (the source rank, shared memory, a large x): call sum_in_step then."""
        if self.is_source or not self.star or x.nbytes > STAR_BYTES or x.device != self.device:
            return None
        return self._star_started(x, x.shape, SUM, self.timeout_s)

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank ends with the source rank's `x` (in place)."""
        if self.world_size > 1 and x.device != self.device:
            return x.copy_(self.broadcast(x.to(self.device)))
        if self.world_size > 1:
            with _peer_failures_named():
                if self.local is not None and x.is_contiguous():
                    self.local.broadcast_(x, 0)
                elif self.star and x.nbytes <= STAR_BYTES and x.is_contiguous():
                    self._star_broadcast(x)
                else:
                    dist.broadcast(x, src=self.src, group=self.group)
        return x

    def broadcast_object(self, obj: Any) -> Any:
        """The source rank's `obj` (picklable), on every rank."""
        if self.world_size == 1:
            return obj
        if self.local is not None or self.star:
            return self._broadcast_pickled(obj)
        box = [obj]
        with _peer_failures_named():
            dist.broadcast_object_list(box, src=self.src, group=self.group, device=self.device)
        return box[0]

    def _star(self, x: torch.Tensor, combine: Callable[[list], torch.Tensor], shape: tuple[int, ...], tag: int,
              timeout_s: Optional[float] = None) -> torch.Tensor:
        """combine(every rank's x, in rank order), of `shape`, on every rank, through the source rank: each other
        rank sends it x and receives the result, as messages of `tag`. `timeout_s`: the longest to wait for a
        message (TimeoutError)."""
        x = x.contiguous()
        if not self.is_source:
            return self._star_started(x, shape, tag, timeout_s)()
        with _peer_failures_named():
            parts = [x] + [self.links[rank].receive(x.shape, x.dtype, tag, timeout_s)
                           for rank in range(1, self.world_size)]
            result = combine(parts).contiguous()
            for rank in range(1, self.world_size):
                self.links[rank].send(result, tag)
            return result

    def _star_started(self, x: torch.Tensor, shape: tuple[int, ...], tag: int,
                      timeout_s: Optional[float]) -> Callable[[], torch.Tensor]:
        """A rank other than the source's side of `_star`, started: x sent; what it returns waits for the result
        (of `shape`)."""
        with _peer_failures_named():
            self.links[0].send(x, tag)

        def finish() -> torch.Tensor:
            with _peer_failures_named():
                return self.links[0].receive(shape, x.dtype, tag, timeout_s)

        return finish

    def _star_broadcast(self, x: torch.Tensor) -> None:
        """The source rank's x, sent to every other rank (in place)."""
        if not self.is_source:
            x.copy_(self.links[0].receive(x.shape, x.dtype, BROADCAST))
            return
        for rank in range(1, self.world_size):
            self.links[rank].send(x, BROADCAST)

    def _broadcast_pickled(self, obj: Any) -> Any:
        """The source rank's `obj` through the segment: its pickle's length, then its bytes."""
        data = pickle.dumps(obj) if self.is_source else b""
        size = int(self.broadcast(torch.tensor([len(data)], dtype=torch.long)))
        buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8) if self.is_source else torch.empty(
            size, dtype=torch.uint8)
        self.broadcast(buffer)
        return obj if self.is_source else pickle.loads(buffer.numpy().tobytes())

    # Picklable objects between the group's ranks, for jobs that plan on one rank and share out the work (batch).

    def all_gather_object(self, obj: Any) -> list:
        """Every rank's `obj` (picklable), in rank order, on every rank."""
        if self.world_size == 1:
            return [obj]
        gathered = [None] * self.world_size
        dist.all_gather_object(gathered, obj, group=self.group)
        return gathered

    def scatter_object(self, per_rank: Optional[list]) -> Any:
        """Rank r's item of the source rank's `per_rank` (one picklable item per rank; None on the other ranks)."""
        if self.world_size == 1:
            return per_rank[0]
        box = [None]
        dist.scatter_object_list(box, per_rank, src=self.src, group=self.group)
        return box[0]

    def gather_object(self, obj: Any) -> Optional[list]:
        """Every rank's `obj` (picklable), in rank order, on the source rank; None elsewhere."""
        if self.world_size == 1:
            return [obj]
        gathered = [None] * self.world_size if self.is_source else None
        dist.gather_object(obj, gathered, dst=self.src, group=self.group)
        return gathered

    def barrier(self) -> None:
        """Wait until every rank of the group is here."""
        if self.world_size > 1:
            dist.barrier(group=self.group)

    def raise_if_any_failed(self, error: Optional[BaseException], *, quiet: bool = False) -> None:
        """Collective: if any rank hit an error, every rank raises, so no rank waits forever in a later collective.

        The failing rank re-raises its own exception. The others raise one that names the failing rank and its
        message or, with `quiet`, exit 2 without a word: a command's user then reads one message, not one per rank.
        """
        reports = self.all_gather_object(None if error is None else f"{type(error).__name__}: {error}")
        if error is not None:
            raise error
        failed = [(rank, msg) for rank, msg in enumerate(reports) if msg is not None]
        if failed and quiet:
            raise SystemExit(2)
        if failed:
            rank, msg = failed[0]
            raise RuntimeError(f"model-parallel rank {rank} failed: {msg}")

    def on_rank0(self, fn: Callable[[], Any]) -> Any:
        """fn() on the group's rank 0 alone (None elsewhere); if it raises, every rank stops, the others quietly
        (`raise_if_any_failed`)."""
        result, error = None, None
        if self.rank == 0:
            try:
                result = fn()
            except Exception as e:  # every rank must hear of it, or the others would wait forever
                error = e
        self.raise_if_any_failed(error, quiet=True)
        return result


@contextmanager
def _peer_failures_named():
    """A collective that fails because a peer left (gloo: "Connection closed by peer") after announcing why (the
    watchdog's store) raises that reason, naming the rank, instead of the transport's message. A peer that gave up
    waiting closes its connections a moment before it announces why: that moment is waited for."""
    try:
        yield
    except RuntimeError as e:
        failed = announced_failure()
        deadline = time.monotonic() + ANNOUNCEMENT_S
        while failed is None and "closed by peer" in str(e) and time.monotonic() < deadline:
            time.sleep(0.05)
            failed = announced_failure()
        if failed is not None:
            raise RanksDisagree(f"rank {failed[0]} failed: {failed[1]}") from e
        if OUT_OF_STEP in str(e):  # the segment saw the ranks in different collectives
            raise CollectivesOutOfStep(str(e)) from None
        raise
